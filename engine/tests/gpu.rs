//! The engine on a CUDA device (feature `cuda`), against the CPU path on a tiny random-weight
//! Llama built by the test: the same logits (f32 within 1e-3, f16 within 3e-2: half-precision
//! weights and cuBLAS's accumulation order), a mixed prefill/decode batch equal to each
//! sequence alone, and KV exported on the GPU, imported on the CPU (and back) giving the same
//! next logits. Without a CUDA device each test prints "skipped: no CUDA device" and passes,
//! unless `PD_REQUIRE_GPU=1` (set by `scripts/gpu-check.sh`, which runs them where there is a
//! device): then a device that fails to initialise fails every test.
#![cfg(feature = "cuda")]

mod common;

use candle_core::Device;
use common::{max_diff, run_alone, tiny_config, tiny_weights, tokens, MapSource};
use pd_engine::{BatchSeq, CacheConfig, KvCache, KvCacheDType, Model, SequenceKv, WeightFormat, WireDType};

fn cuda() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) if std::env::var("PD_REQUIRE_GPU").is_ok_and(|v| v == "1") => {
            panic!("PD_REQUIRE_GPU=1 and no CUDA device: {e}")
        }
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
    }
}

fn model_on(device: &Device, format: WeightFormat, seed: u64) -> Model {
    let config = tiny_config();
    let mut source = MapSource(tiny_weights(&config, seed));
    Model::load(config, &mut source, format, device).expect("tiny model loads")
}

/// An f32 cache unless said otherwise: the comparisons check the math, and an f16 cache rounds
/// K/V computed in different orders on the two devices to different halves at the edges.
fn cache_on(model: &Model, device: &Device) -> KvCache {
    cache_of(model, device, KvCacheDType::F32)
}

fn cache_of(model: &Model, device: &Device, dtype: KvCacheDType) -> KvCache {
    let config = CacheConfig { prefix_cache: false, block_size: 4, dtype, ..CacheConfig::with_blocks(64) };
    KvCache::new(model.config(), &config, device).expect("cache")
}

#[test]
fn gpu_logits_match_the_cpu_path() {
    let Some(gpu) = cuda() else { return };
    // f16 weights with the default f16 KV cache: the bound covers both roundings.
    for (format, kv, tolerance) in
        [(WeightFormat::F32, KvCacheDType::F32, 1e-3f32), (WeightFormat::F16, KvCacheDType::F16, 3e-2)]
    {
        let (cpu_model, gpu_model) = (model_on(&Device::Cpu, format, 7), model_on(&gpu, format, 7));
        let (cpu_cache, gpu_cache) = (cache_of(&cpu_model, &Device::Cpu, kv), cache_of(&gpu_model, &gpu, kv));
        let prompt = tokens(11, 2);
        let mut a = SequenceKv::new(cpu_cache.block_manager().empty_allocation());
        let mut b = SequenceKv::new(gpu_cache.block_manager().empty_allocation());
        let want = run_alone(&cpu_model, &cpu_cache, &mut a, &[&prompt, &[5], &[9]]);
        let got = run_alone(&gpu_model, &gpu_cache, &mut b, &[&prompt, &[5], &[9]]);
        let diff = max_diff(&got, &want);
        assert!(
            diff <= tolerance,
            "{format:?} weights, {kv:?} KV: GPU logits differ from CPU by {diff} (allowed {tolerance})"
        );
    }
}

#[test]
fn a_mixed_batch_on_the_gpu_equals_each_sequence_alone() {
    let Some(gpu) = cuda() else { return };
    let model = model_on(&gpu, WeightFormat::F32, 1);
    let cache = cache_on(&model, &gpu);
    let blocks = cache.block_manager();
    let (a_prompt, b_prompt) = (tokens(5, 1), tokens(7, 2));
    let mut a = SequenceKv::new(blocks.empty_allocation());
    let a_alone = run_alone(&model, &cache, &mut a, &[&a_prompt, &[11]]);
    let mut b = SequenceKv::new(blocks.empty_allocation());
    let b_alone = run_alone(&model, &cache, &mut b, &[&b_prompt]);
    let mut a2 = SequenceKv::new(blocks.empty_allocation());
    run_alone(&model, &cache, &mut a2, &[&a_prompt]);
    let mut b2 = SequenceKv::new(blocks.empty_allocation());
    let together = model
        .forward(
            &cache,
            &mut [
                BatchSeq { tokens: &[11], kv: &mut a2, want_logits: true },
                BatchSeq { tokens: &b_prompt, kv: &mut b2, want_logits: true },
            ],
        )
        .expect("mixed batch");
    for (i, alone) in [a_alone, b_alone].iter().enumerate() {
        let diff = max_diff(&together.get(i).expect("row"), alone);
        assert!(diff < 1e-3, "sequence {i}: batched logits on the GPU differ by {diff}");
    }
}

#[test]
fn kv_exported_on_the_gpu_and_imported_on_the_cpu_gives_the_same_next_logits() {
    let Some(gpu) = cuda() else { return };
    let (gpu_model, cpu_model) = (model_on(&gpu, WeightFormat::F32, 3), model_on(&Device::Cpu, WeightFormat::F32, 3));
    let (gpu_cache, cpu_cache) = (cache_on(&gpu_model, &gpu), cache_on(&cpu_model, &Device::Cpu));
    let prompt = tokens(13, 5);
    let mut kv = SequenceKv::new(gpu_cache.block_manager().empty_allocation());
    run_alone(&gpu_model, &gpu_cache, &mut kv, &[&prompt]);
    let layers = 0..gpu_model.config().num_layers;
    let bytes =
        pd_engine::kv::export::export_kv(&gpu_model, &gpu_cache, &kv, layers.clone(), WireDType::F32).expect("export");
    let expected = run_alone(&gpu_model, &gpu_cache, &mut kv, &[&[9]]);
    // GPU -> CPU.
    let mut on_host =
        pd_engine::kv::export::import_kv(&cpu_model, &cpu_cache, &cpu_cache.block_manager(), &bytes).expect("import");
    let host_next = run_alone(&cpu_model, &cpu_cache, &mut on_host, &[&[9]]);
    let diff = max_diff(&host_next, &expected);
    assert!(diff <= 1e-3, "next logits after GPU -> CPU differ by {diff}");
    // CPU -> GPU: the host's KV (now 14 tokens) back onto the device.
    let back =
        pd_engine::kv::export::export_kv(&cpu_model, &cpu_cache, &on_host, layers, WireDType::F32).expect("export");
    let gpu_cache2 = cache_on(&gpu_model, &gpu);
    let mut on_device =
        pd_engine::kv::export::import_kv(&gpu_model, &gpu_cache2, &gpu_cache2.block_manager(), &back).expect("import");
    let mut host = on_host;
    let want = run_alone(&cpu_model, &cpu_cache, &mut host, &[&[4]]);
    let got = run_alone(&gpu_model, &gpu_cache2, &mut on_device, &[&[4]]);
    let diff = max_diff(&got, &want);
    assert!(diff <= 1e-3, "next logits after CPU -> GPU differ by {diff}");
}

/// The paged decode kernel at real head geometry (64-wide heads, 4 query heads per KV head)
/// over a context longer than a thread block (300 positions): CPU and GPU agree for both
/// cache types, step after step.
#[test]
fn long_context_decode_on_the_gpu_matches_the_cpu() {
    let Some(gpu) = cuda() else { return };
    let config = pd_engine::ModelConfig {
        hidden_size: 512,
        intermediate_size: 256,
        num_heads: 8,
        num_kv_heads: 2,
        head_dim: 64,
        max_position: 512,
        ..tiny_config()
    };
    let load = |device: &Device| {
        let mut source = MapSource(tiny_weights(&config, 11));
        Model::load(config.clone(), &mut source, WeightFormat::F32, device).expect("model loads")
    };
    let (cpu_model, gpu_model) = (load(&Device::Cpu), load(&gpu));
    for (kv, tolerance) in [(KvCacheDType::F32, 1e-3f32), (KvCacheDType::F16, 3e-2)] {
        let cache = CacheConfig { prefix_cache: false, block_size: 16, dtype: kv, ..CacheConfig::with_blocks(32) };
        let cpu_cache = KvCache::new(cpu_model.config(), &cache, &Device::Cpu).expect("cache");
        let gpu_cache = KvCache::new(gpu_model.config(), &cache, &gpu).expect("cache");
        let prompt = tokens(300, 9);
        let mut a = SequenceKv::new(cpu_cache.block_manager().empty_allocation());
        let mut b = SequenceKv::new(gpu_cache.block_manager().empty_allocation());
        let steps: [&[u32]; 4] = [&prompt, &[3], &[7], &[1]];
        let want = run_alone(&cpu_model, &cpu_cache, &mut a, &steps);
        let got = run_alone(&gpu_model, &gpu_cache, &mut b, &steps);
        let diff = max_diff(&got, &want);
        assert!(diff <= tolerance, "{kv:?} KV: GPU decode after 300 tokens differs from CPU by {diff}");
    }
}

/// KV-transfer frames (`read_blocks` / `write_blocks`) through the pinned staging buffers:
/// bytes written into GPU blocks come back unchanged, in either wire type, and equal what a
/// CPU cache holding the same values gives.
#[test]
fn kv_frames_round_trip_through_gpu_blocks() {
    let Some(gpu) = cuda() else { return };
    use pd_engine::kv::export::{read_blocks, write_blocks};
    let model = model_on(&gpu, WeightFormat::F32, 5);
    for kv in [KvCacheDType::F16, KvCacheDType::F32] {
        let (gpu_cache, cpu_cache) = (cache_of(&model, &gpu, kv), cache_of(&model, &Device::Cpu, kv));
        let mut seq = SequenceKv::new(gpu_cache.block_manager().empty_allocation());
        run_alone(&model, &gpu_cache, &mut seq, &[&tokens(15, 4)]);
        for wire in [WireDType::F16, WireDType::F32] {
            for layer in 0..model.config().num_layers {
                let frame = read_blocks(&gpu_cache, layer, &[0, 1, 2, 3], wire).expect("read");
                write_blocks(&gpu_cache, layer, &[9, 8, 7, 6], wire, &frame).expect("write");
                let back = read_blocks(&gpu_cache, layer, &[9, 8, 7, 6], wire).expect("read back");
                assert_eq!(back, frame, "{kv:?} cache, {wire:?} frame, layer {layer}: GPU round trip");
                write_blocks(&cpu_cache, layer, &[0, 1, 2, 3], wire, &frame).expect("write on CPU");
                let host = read_blocks(&cpu_cache, layer, &[0, 1, 2, 3], wire).expect("read on CPU");
                assert_eq!(host, frame, "{kv:?} cache, {wire:?} frame, layer {layer}: GPU and CPU bytes");
            }
        }
    }
}
