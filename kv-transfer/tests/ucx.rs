//! The UCX transport on loopback (tcp and shared memory): bit-exact KV at scattered blocks,
//! concurrent transfers, refusals with their reason. Traffic stays on `lo`.
#![cfg(feature = "ucx")]

mod common;

use std::time::Duration;

use common::{assert_landed, frames, geometry, Receiver};
use pd_engine::WireDType;
use pd_kv_transfer::kv_commit;
use pd_kv_transfer::ucx::{UcxConfig, UcxKvReceiver, UcxKvSender};
use pd_kv_transfer::{KvReceiver, KvSender, KvTransfer};

const LEASE: Duration = Duration::from_secs(30);
const TIMEOUT: Duration = Duration::from_secs(10);

fn configs() -> [(&'static str, UcxConfig); 2] {
    [("tcp", UcxConfig::loopback_tcp()), ("shared memory", UcxConfig::loopback_shared_memory())]
}

async fn connect(r: &Receiver, config: &UcxConfig) -> (UcxKvReceiver, UcxKvSender) {
    let loopback = "127.0.0.1:0".parse().expect("addr");
    let server = UcxKvReceiver::start(r.registry.clone(), config.clone(), loopback).expect("UCX receiver");
    let sender = UcxKvSender::connect(server.local_addr(), config.clone(), TIMEOUT).await.expect("UCX connect");
    (server, sender)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_kv_arrives_bit_exact_over_tcp_and_shared_memory() {
    for (name, config) in configs() {
        for dtype in [WireDType::F16, WireDType::F32] {
            // Wide blocks so frames go by rendezvous as well as eagerly.
            let mut g = geometry(dtype, 4);
            g.num_kv_heads = 8;
            g.head_dim = 64;
            let r = Receiver::new(g, 64);
            let held: Vec<_> = (0..20).map(|_| r.blocks.allocate(1).expect("block")).collect();
            let odd: Vec<_> = held.into_iter().enumerate().filter(|(i, _)| i % 2 == 1).map(|(_, b)| b).collect();
            let (header, outcome) = r.reserve("scattered", 300, LEASE);
            drop(odd);
            let (server, sender) = connect(&r, &config).await;
            let mut all = frames(&header, 21, 4);
            all.reverse();
            let mut transfer = sender.start(header.clone()).await.expect("accepted");
            for f in &all {
                transfer.send(f.clone()).await.expect("send");
            }
            let receipt = transfer.commit(kv_commit(5, 300)).await.expect("commit");
            assert_eq!(receipt.frames as usize, all.len(), "{name} {dtype:?}");
            let committed = outcome.await.expect("outcome").expect("committed");
            assert_landed(&r, &header, &all);
            drop(committed);
            assert!(r.all_free());
            server.shutdown().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_sender_takes_over_a_transfer_whose_first_endpoint_is_still_open() {
    for (_, config) in configs() {
        let r = Receiver::new(geometry(WireDType::F16, 2), 8);
        let (server, first) = connect(&r, &config).await;
        let second = UcxKvSender::connect(server.local_addr(), config.clone(), TIMEOUT).await.expect("UCX connect");
        common::a_newer_sender_takes_over(&r, &first, &second).await;
        server.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_transfers_do_not_mix() {
    let r = Receiver::new(geometry(WireDType::F16, 3), 16 * 5);
    let (server, sender) = connect(&r, &UcxConfig::loopback_shared_memory()).await;
    let mut tasks = Vec::new();
    let mut expected = Vec::new();
    for i in 0..16u64 {
        let (header, outcome) = r.reserve(&format!("t{i}"), 70, LEASE);
        let all = frames(&header, 300 + i, 1);
        expected.push((header.clone(), all.clone(), outcome));
        let sender = sender.clone();
        tasks.push(tokio::spawn(async move {
            let mut transfer = sender.start(header).await?;
            for f in all {
                transfer.send(f).await?;
                tokio::task::yield_now().await;
            }
            transfer.commit(kv_commit(i as u32, 70)).await
        }));
    }
    for task in tasks {
        task.await.expect("task").expect("transfer");
    }
    for (header, all, outcome) in expected {
        drop(outcome.await.expect("outcome").expect("committed"));
        assert_landed(&r, &header, &all);
    }
    assert!(r.all_free());
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_reach_the_sender_and_free_the_blocks() {
    let r = Receiver::new(geometry(WireDType::F16, 2), 16);
    let (server, sender) = connect(&r, &UcxConfig::loopback_tcp()).await;

    let (mut header, outcome) = r.reserve("bad-handshake", 40, LEASE);
    header.geometry.block_size = 32;
    let err = sender.start(header).await.expect_err("refused");
    assert_eq!(err.kind(), "incompatible", "{err}");
    assert!(outcome.await.expect("outcome").is_err());
    assert!(r.all_free());

    let (header, outcome) = r.reserve("corrupt", 40, LEASE);
    let mut all = frames(&header, 9, 3);
    all[0].data[3] ^= 0x40;
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
    server.shutdown().await;
}
