fn main() {
    let path = std::path::Path::new("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut f = std::fs::File::open(path).unwrap();
    let ct = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
    let mut keys: Vec<_> = ct.metadata.iter().filter(|(k, _)| !k.contains("tokens") && !k.contains("merges") && !k.contains("token_type")).collect();
    keys.sort_by_key(|(k, _)| k.to_string());
    for (k, v) in keys { println!("{k} = {:?}", format!("{v:?}").chars().take(120).collect::<String>()); }
    let e = pd_engine::Engine::load(path, Default::default(), pd_engine::CacheConfig::with_blocks(8)).unwrap();
    for variant in [true, false] {
        let mut ids = e.chat_prompt(&[pd_engine::ChatMessage::new("user", "What is the capital of France?")]).unwrap();
        if !variant { ids.insert(0, 1); }
        let mut kv = e.new_sequence();
        let logits = e.prefill(&mut kv, &ids, 512).unwrap().to_vec1::<f32>().unwrap();
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|a, b| logits[*b].partial_cmp(&logits[*a]).unwrap());
        for i in &idx[..5] { print!("{:?}={:.2} ", e.tokenizer().id_to_token(*i as u32).unwrap(), logits[*i]); }
        println!();
    }
}
