//! The gRPC transport on loopback: KV arrives bit-exact at scattered blocks in both dtypes,
//! concurrent transfers do not mix, refusals reach the sender, blocks are freed.

mod common;

use std::time::Duration;

use common::{assert_landed, frames, geometry, Receiver};
use pd_engine::WireDType;
use pd_kv_transfer::grpc::{GrpcKvReceiver, GrpcKvSender};
use pd_kv_transfer::kv_commit;
use pd_kv_transfer::{KvReceiver, KvSender, KvTransfer};
use tokio::net::TcpListener;

const LEASE: Duration = Duration::from_secs(30);
const TIMEOUT: Duration = Duration::from_secs(10);

async fn serve(receiver: &Receiver) -> GrpcKvReceiver {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
    GrpcKvReceiver::start(receiver.registry.clone(), listener).expect("start receiver")
}

#[tokio::test]
async fn random_kv_arrives_bit_exact_in_scattered_blocks() {
    for dtype in [WireDType::F16, WireDType::F32] {
        let r = Receiver::new(geometry(dtype, 4), 64);
        // Scatter the free list: hold every other block while reserving.
        let held: Vec<_> = (0..20).map(|_| r.blocks.allocate(1).expect("one block")).collect();
        let odd: Vec<_> = held.into_iter().enumerate().filter(|(i, _)| i % 2 == 1).map(|(_, b)| b).collect();
        let (header, outcome) = r.reserve("scattered", 150, LEASE);
        drop(odd);
        let ids = &header.block_ids;
        assert!(ids.windows(2).any(|w| w[0].abs_diff(w[1]) != 1), "blocks are not contiguous: {ids:?}");
        let server = serve(&r).await;
        let sender = GrpcKvSender::connect(&server.local_addr().to_string(), TIMEOUT).await.expect("connect");
        let mut all = frames(&header, 11, 3);
        all.reverse(); // layers and blocks out of order
        let mut transfer = sender.start(header.clone()).await.expect("accepted");
        for f in &all {
            transfer.send(f.clone()).await.expect("send");
        }
        let receipt = transfer.commit(kv_commit(7, 150)).await.expect("commit");
        assert_eq!(receipt.frames as usize, all.len());
        let committed = outcome.await.expect("outcome").expect("committed");
        assert_eq!(committed.first_token, 7);
        assert_landed(&r, &header, &all);
        drop(committed);
        assert!(r.all_free());
        server.shutdown().await;
    }
}

#[tokio::test]
async fn sixteen_concurrent_transfers_do_not_mix() {
    let r = Receiver::new(geometry(WireDType::F16, 3), 16 * 5);
    let server = serve(&r).await;
    let addr = server.local_addr().to_string();
    let mut tasks = Vec::new();
    let mut expected = Vec::new();
    for i in 0..16u64 {
        let (header, outcome) = r.reserve(&format!("t{i}"), 70, LEASE);
        let all = frames(&header, 100 + i, 1);
        expected.push((header.clone(), all.clone(), outcome));
        let addr = addr.clone();
        tasks.push(tokio::spawn(async move {
            let sender = GrpcKvSender::connect(&addr, TIMEOUT).await?;
            let mut transfer = sender.start(header).await?;
            for f in all {
                transfer.send(f).await?;
                tokio::task::yield_now().await; // interleave with the other transfers
            }
            transfer.commit(kv_commit(i as u32, 70)).await
        }));
    }
    for task in tasks {
        task.await.expect("task").expect("transfer");
    }
    for (header, all, outcome) in expected {
        let committed = outcome.await.expect("outcome").expect("committed");
        assert_landed(&r, &header, &all);
        drop(committed);
    }
    assert!(r.all_free());
    server.shutdown().await;
}

#[tokio::test]
async fn a_newer_sender_takes_over_a_transfer_whose_first_stream_is_still_open() {
    let r = Receiver::new(geometry(WireDType::F16, 2), 8);
    let server = serve(&r).await;
    let addr = server.local_addr().to_string();
    let first = GrpcKvSender::connect(&addr, TIMEOUT).await.expect("connect");
    let second = GrpcKvSender::connect(&addr, TIMEOUT).await.expect("connect");
    common::a_newer_sender_takes_over(&r, &first, &second).await;
    server.shutdown().await;
}

#[tokio::test]
async fn refusals_reach_the_sender_with_their_reason() {
    let r = Receiver::new(geometry(WireDType::F16, 2), 16);
    let server = serve(&r).await;
    let sender = GrpcKvSender::connect(&server.local_addr().to_string(), TIMEOUT).await.expect("connect");

    // Incompatible handshake: refused before any frame, blocks freed.
    let (mut header, outcome) = r.reserve("bad-handshake", 40, LEASE);
    header.geometry.model_fingerprint = 1;
    let err = sender.start(header).await.expect_err("refused");
    assert_eq!(err.kind(), "incompatible", "{err}");
    assert!(err.to_string().contains("fingerprint"), "{err}");
    assert!(outcome.await.expect("outcome").is_err());
    assert!(r.all_free());

    // Corrupted frame mid-stream: the next send or the commit reports it.
    let (header, outcome) = r.reserve("corrupt", 40, LEASE);
    let mut all = frames(&header, 9, 3);
    all[1].data[0] ^= 1;
    let mut transfer = sender.start(header).await.expect("accepted");
    let mut failure = None;
    for f in all {
        if let Err(e) = transfer.send(f).await {
            failure = Some(e);
            break;
        }
    }
    let err = match failure {
        Some(e) => e,
        None => transfer.commit(kv_commit(0, 40)).await.expect_err("refused"),
    };
    assert!(err.to_string().contains("checksum"), "{err}");
    assert!(outcome.await.expect("outcome").is_err());
    assert!(r.all_free());

    // Unknown transfer.
    let (mut header, _outcome) = r.reserve("real", 16, LEASE);
    header.transfer_id = "ghost".into();
    assert_eq!(sender.start(header).await.expect_err("unknown").kind(), "unknown_transfer");

    // Explicit abort frees the blocks.
    let (header, outcome) = r.reserve("aborted", 16, LEASE);
    let mut transfer = sender.start(header.clone()).await.expect("accepted");
    transfer.send(frames(&header, 1, 1).remove(0)).await.expect("send");
    transfer.abort("prefill failed").await;
    let err = outcome.await.expect("outcome").expect_err("aborted");
    assert!(err.to_string().contains("prefill failed"), "{err}");
    server.shutdown().await;
}

#[tokio::test]
async fn an_absent_receiver_fails_the_sender_within_its_timeout() {
    let timeout = Duration::from_millis(800);
    let started = std::time::Instant::now();
    // Nothing listens on this port (bound, then released).
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr")
    };
    let err = GrpcKvSender::connect(&addr.to_string(), timeout).await.expect_err("nobody there");
    assert_eq!(err.kind(), "transport");
    assert!(started.elapsed() < timeout + Duration::from_secs(1));
}
