use candle_core::{Device, Tensor};
fn main() {
    let path = std::path::Path::new("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let opts = pd_engine::LoadOptions { weights: pd_engine::WeightFormat::Stored, ..Default::default() };
    let e = pd_engine::Engine::load(path, opts, pd_engine::CacheConfig::with_blocks(8)).unwrap();
    let ids = e.chat_prompt(&[pd_engine::ChatMessage::new("user", "What is the capital of France?")]).unwrap();
    let mut kv = e.new_sequence();
    let ours = e.prefill(&mut kv, &ids, 512).unwrap();
    let mut f = std::fs::File::open(path).unwrap();
    let ct = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
    let mut reference = candle_transformers::models::quantized_llama::ModelWeights::from_gguf(ct, &mut f, &Device::Cpu).unwrap();
    let input = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let theirs = reference.forward(&input, 0).unwrap().squeeze(0).unwrap();
    let d = (ours.clone() - theirs.clone()).unwrap().abs().unwrap().max_all().unwrap();
    println!("max diff {} argmax ours {} theirs {}", d.to_scalar::<f32>().unwrap(), ours.argmax(0).unwrap().to_scalar::<u32>().unwrap(), theirs.argmax(0).unwrap().to_scalar::<u32>().unwrap());
}
