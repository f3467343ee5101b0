//! A 256 MiB transfer over gRPC on loopback completes with bounded memory: the process's peak
//! RSS grows by the destination's size plus a bounded margin, never by a second copy of the
//! whole transfer. Alone in its test binary so no other test moves the peak.

mod common;

use std::time::Duration;

use common::{payload, Receiver};
use pd_engine::WireDType;
use pd_kv_transfer::grpc::{GrpcKvReceiver, GrpcKvSender};
use pd_kv_transfer::kv_commit;
use pd_kv_transfer::{frame_runs, Frame, KvGeometry, KvReceiver, KvSender, KvTransfer};

fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("VmHWM");
    line.split_whitespace().nth(1).and_then(|kib| kib.parse::<u64>().ok()).expect("number") * 1024
}

fn frame_data(layer: u32, first: u32, bytes: usize) -> Vec<u8> {
    payload(((layer as u64) << 20) | first as u64, bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_of_256_mib_keeps_memory_bounded() {
    const MIB: u64 = 1 << 20;
    let geometry = KvGeometry {
        model_fingerprint: 9,
        dtype: WireDType::F16,
        num_layers: 32,
        block_size: 16,
        num_kv_heads: 8,
        head_dim: 128,
    };
    let blocks = 128;
    let total = (geometry.num_layers as usize * geometry.frame_bytes(blocks)) as u64;
    assert_eq!(total, 256 * MIB);
    let r = Receiver::new(geometry, blocks);
    let (header, outcome) = r.reserve("big", (blocks * 16) as u32, Duration::from_secs(120));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let server = GrpcKvReceiver::start(r.registry.clone(), listener).expect("receiver");
    let sender =
        GrpcKvSender::connect(&server.local_addr().to_string(), Duration::from_secs(20)).await.expect("connect");

    let before = peak_rss_bytes();
    let mut transfer = sender.start(header.clone()).await.expect("accepted");
    for layer in 0..geometry.num_layers {
        for (first, count) in frame_runs(&geometry, blocks) {
            let data = frame_data(layer, first, geometry.frame_bytes(count as usize));
            transfer.send(Frame::new(layer, first, count, data)).await.expect("send");
        }
    }
    let receipt = transfer.commit(kv_commit(0, (blocks * 16) as u32)).await.expect("commit");
    assert_eq!(receipt.bytes, total);
    let growth = peak_rss_bytes().saturating_sub(before);
    eprintln!("peak RSS growth {} MiB for {} MiB", growth / MIB, total / MIB);
    assert!(
        growth <= total + 96 * MIB,
        "peak RSS grew by {} MiB for a {} MiB transfer into {} MiB of destination",
        growth / MIB,
        total / MIB,
        total / MIB
    );

    let committed = outcome.await.expect("outcome").expect("committed");
    for layer in 0..geometry.num_layers {
        for (first, count) in frame_runs(&geometry, blocks) {
            let data = frame_data(layer, first, geometry.frame_bytes(count as usize));
            let per_block = pd_kv_transfer::receiver::split_frame_payload(&geometry, count as usize, &data);
            for (i, expected) in per_block.iter().enumerate() {
                let id = header.block_ids[first as usize + i];
                assert!(r.sink.block(layer, id) == *expected, "layer {layer} block {id} differs");
            }
        }
    }
    drop(committed);
    assert!(r.all_free());
    server.shutdown().await;
}
