//! Faults with real processes: a receiver killed mid-transfer makes the sender fail within
//! its timeout; a sender killed mid-transfer leaves the blocks reserved until the lease ends,
//! then they are freed.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{frames, geometry, Receiver};
use pd_engine::WireDType;
use pd_kv_transfer::grpc::{GrpcKvReceiver, GrpcKvSender};
use pd_kv_transfer::kv_commit;
use pd_kv_transfer::{KvReceiver, KvSender, KvTransfer};

const PEER: &str = env!("CARGO_BIN_EXE_pd-kv-peer");

/// Kills the child when the test ends, however it ends.
struct Peer(Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(args: &[&str]) -> (Peer, std::sync::mpsc::Receiver<String>) {
    let mut child = Command::new(PEER)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start pd-kv-peer");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (Peer(child), rx)
}

fn wait_for(lines: &std::sync::mpsc::Receiver<String>, prefix: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = Vec::new();
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match lines.recv_timeout(left) {
            Ok(line) if line.starts_with(prefix) => return line,
            Ok(line) => seen.push(line),
            Err(_) => break,
        }
    }
    panic!("pd-kv-peer never printed `{prefix}`; it printed {seen:?}");
}

fn parse_blocks(line: &str) -> Vec<u32> {
    line.trim_start_matches("blocks ").split(',').map(|id| id.parse().expect("block id")).collect()
}

/// Starts a receiver process on `transport`, streams into it from this process through
/// `connect`, kills it, and checks the sender fails within its timeout.
async fn killed_receiver_case<S, F, Fut>(transport: &str, connect: F)
where
    S: KvSender,
    F: FnOnce(String, Duration) -> Fut,
    Fut: std::future::Future<Output = S>,
{
    let (mut peer, lines) = spawn(&[
        "receive",
        "--transport",
        transport,
        "--transfer-id",
        "victim",
        "--tokens",
        "512",
        "--layers",
        "4",
        "--lease-ms",
        "60000",
    ]);
    let addr = wait_for(&lines, "listening ").trim_start_matches("listening ").to_string();
    let block_ids = parse_blocks(&wait_for(&lines, "blocks "));
    let timeout = Duration::from_secs(2);
    let sender = connect(addr, timeout).await;
    let header = pd_kv_transfer::TransferHeader {
        transfer_id: "victim".into(),
        geometry: pd_kv_transfer::KvGeometry {
            model_fingerprint: 0x5eed,
            dtype: WireDType::F16,
            num_layers: 4,
            block_size: 16,
            num_kv_heads: 2,
            head_dim: 8,
        },
        block_ids,
        num_tokens: 512,
        trace_context: Default::default(),
    };
    let all = frames(&header, 3, 1);
    let mut transfer = sender.start(header).await.expect("accepted");
    for f in all.iter().take(4) {
        transfer.send(f.clone()).await.expect("send before the kill");
    }
    peer.0.kill().expect("kill receiver");
    let killed_at = Instant::now();
    let mut result = Ok(());
    for f in all.iter().skip(4) {
        result = transfer.send(f.clone()).await;
        if result.is_err() {
            break;
        }
    }
    let err = match result {
        Err(e) => e,
        Ok(()) => transfer.commit(kv_commit(1, 512)).await.expect_err("receiver is dead"),
    };
    let took = killed_at.elapsed();
    assert!(took <= timeout + Duration::from_millis(500), "{transport}: sender noticed after {took:?}: {err}");
    assert!(matches!(err.kind(), "transport" | "timeout"), "{transport}: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_receiver_fails_the_sender_within_its_timeout() {
    killed_receiver_case("grpc", |addr, timeout| async move {
        GrpcKvSender::connect(&addr, timeout).await.expect("connect")
    })
    .await;
}

#[cfg(feature = "ucx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_ucx_receiver_fails_the_sender_within_its_timeout() {
    use pd_kv_transfer::ucx::{UcxConfig, UcxKvSender};
    killed_receiver_case("ucx-tcp", |addr, timeout| async move {
        UcxKvSender::connect(addr.parse().expect("addr"), UcxConfig::loopback_tcp(), timeout).await.expect("connect")
    })
    .await;
}

/// Receives here on `transport`, kills the sending process mid-transfer, and checks the
/// blocks stay reserved until the lease ends and are then all freed.
async fn killed_sender_case(transport: &str) {
    let r = Receiver::new(geometry(WireDType::F16, 4), 32);
    // Long enough for a sender process to start and connect on a loaded 2-core machine.
    let lease = Duration::from_millis(4000);
    let (header, outcome) = r.reserve("orphan", 512, lease);
    let ids: Vec<String> = header.block_ids.iter().map(u32::to_string).collect();
    let ids = ids.join(",");
    let reserved_at = Instant::now();
    let (server, addr): (Box<dyn std::any::Any + Send>, String) = match transport {
        "grpc" => {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let server = GrpcKvReceiver::start(r.registry.clone(), listener).expect("receiver");
            let addr = server.local_addr().to_string();
            (Box::new(server), addr)
        }
        #[cfg(feature = "ucx")]
        _ => {
            use pd_kv_transfer::ucx::{UcxConfig, UcxKvReceiver};
            let loopback = "127.0.0.1:0".parse().expect("addr");
            let server =
                UcxKvReceiver::start(r.registry.clone(), UcxConfig::loopback_tcp(), loopback).expect("receiver");
            let addr = server.local_addr().to_string();
            (Box::new(server), addr)
        }
        #[cfg(not(feature = "ucx"))]
        other => panic!("transport {other} needs the ucx feature"),
    };
    let (mut peer, lines) = spawn(&[
        "send",
        "--transport",
        transport,
        "--to",
        &addr,
        "--block-ids",
        &ids,
        "--transfer-id",
        "orphan",
        "--tokens",
        "512",
        "--layers",
        "4",
        "--frame-delay-ms",
        "100",
    ]);
    wait_for(&lines, "sent 2");
    peer.0.kill().expect("kill sender");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(r.blocks.free_blocks(), 0, "{transport}: blocks stay reserved for a retry while the lease holds");
    let err = outcome.await.expect("outcome").expect_err("never committed");
    assert_eq!(err.kind(), "lease_expired", "{transport}: {err}");
    let freed_after = reserved_at.elapsed();
    assert!(freed_after >= lease && freed_after < lease + Duration::from_secs(1), "freed after {freed_after:?}");
    assert!(r.all_free(), "{transport}: every block is back");
    assert!(r.registry.is_empty());
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_sender_leaves_blocks_reserved_until_the_lease_frees_them() {
    killed_sender_case("grpc").await;
}

#[cfg(feature = "ucx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_ucx_sender_leaves_blocks_reserved_until_the_lease_frees_them() {
    killed_sender_case("ucx-tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_processes_complete_a_transfer() {
    let (_receiver, lines) =
        spawn(&["receive", "--transfer-id", "ok", "--tokens", "300", "--layers", "3", "--lease-ms", "20000"]);
    let addr = wait_for(&lines, "listening ").trim_start_matches("listening ").to_string();
    let ids = wait_for(&lines, "blocks ").trim_start_matches("blocks ").to_string();
    let (_sender, sender_lines) =
        spawn(&["send", "--to", &addr, "--block-ids", &ids, "--transfer-id", "ok", "--tokens", "300", "--layers", "3"]);
    wait_for(&sender_lines, "committed");
    assert!(wait_for(&lines, "outcome").starts_with("outcome committed"));
    assert_eq!(wait_for(&lines, "free_blocks"), "free_blocks 19 of 19");
}
