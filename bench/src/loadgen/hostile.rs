//! Hostile clients beside a load run (`pd-bench hostile`): connections that open and never
//! send a byte, slow readers that start a long streaming answer and then read one byte per
//! second from a small receive buffer, and a `/health` probe on a fresh connection every
//! 100 ms, as a Kubernetes kubelet would. Reports what the server kept answering: health
//! latency percentiles and failures, how many idle connections the server still holds at the
//! end, and how far each slow reader got. Bounded by `duration` and by the counts given.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// What to throw at the server.
#[derive(Debug, Clone)]
pub struct Hostile {
    /// The server's HTTP address.
    pub addr: SocketAddr,
    pub model: String,
    /// Connections opened and left silent.
    pub idle: usize,
    /// Streaming requests whose answer is read one byte per second.
    pub slow: usize,
    /// `max_tokens` of each slow reader's request.
    pub slow_tokens: u32,
    pub duration: Duration,
}

/// What the server did meanwhile.
#[derive(Debug, Serialize)]
pub struct HostileReport {
    pub duration_s: f64,
    pub idle_opened: usize,
    pub idle_failed_to_open: usize,
    /// Idle connections the server had closed by the end (it may time silent ones out).
    pub idle_closed_by_server: usize,
    pub health_probes: usize,
    pub health_failures: usize,
    pub health_p50_ms: f64,
    pub health_p99_ms: f64,
    pub health_max_ms: f64,
    /// Probes slower than 100 ms.
    pub health_over_100ms: usize,
    pub slow_readers: usize,
    /// Bytes each slow reader had taken by the end.
    pub slow_bytes_read: Vec<usize>,
}

/// Runs the hostile clients for `h.duration` and reports.
pub async fn run(h: &Hostile) -> HostileReport {
    let started = Instant::now();
    let deadline = started + h.duration;
    let mut idle = Vec::with_capacity(h.idle);
    let mut idle_failed = 0;
    for _ in 0..h.idle {
        match tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(h.addr)).await {
            Ok(Ok(s)) => idle.push(s),
            _ => idle_failed += 1,
        }
    }
    let slow: Vec<_> = (0..h.slow).map(|i| tokio::spawn(slow_reader(h.clone(), i, deadline))).collect();
    let probes = probe_health(h.addr, deadline).await;
    let mut slow_bytes_read = Vec::new();
    for task in slow {
        slow_bytes_read.push(task.await.unwrap_or(0));
    }
    let idle_closed_by_server = idle.iter().filter(|s| closed(s)).count();
    let mut ms: Vec<f64> = probes.iter().filter_map(|p| *p).collect();
    ms.sort_by(f64::total_cmp);
    let pct = |q: f64| pd_telemetry::percentile(&ms, q).unwrap_or(f64::NAN);
    HostileReport {
        duration_s: started.elapsed().as_secs_f64(),
        idle_opened: idle.len(),
        idle_failed_to_open: idle_failed,
        idle_closed_by_server,
        health_probes: probes.len(),
        health_failures: probes.iter().filter(|p| p.is_none()).count(),
        health_p50_ms: pct(0.50),
        health_p99_ms: pct(0.99),
        health_max_ms: ms.last().copied().unwrap_or(f64::NAN),
        health_over_100ms: ms.iter().filter(|m| **m > 100.0).count(),
        slow_readers: h.slow,
        slow_bytes_read,
    }
}

/// True when the peer has closed the connection (a read would see the end or an error).
fn closed(s: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    match s.try_read(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    }
}

/// One `/health` request on a fresh connection every 100 ms until `deadline`: its latency
/// in ms, or None when it failed or took over 2 s.
async fn probe_health(addr: SocketAddr, deadline: Instant) -> Vec<Option<f64>> {
    let mut out = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    while Instant::now() < deadline {
        tick.tick().await;
        let t = Instant::now();
        let ok = tokio::time::timeout(Duration::from_secs(2), health_once(addr)).await;
        out.push(matches!(ok, Ok(Ok(true))).then(|| t.elapsed().as_secs_f64() * 1e3));
    }
    out
}

async fn health_once(addr: SocketAddr) -> std::io::Result<bool> {
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(b"GET /health HTTP/1.1\r\nhost: pd\r\nconnection: close\r\n\r\n").await?;
    let mut response = Vec::new();
    s.read_to_end(&mut response).await?;
    Ok(response.starts_with(b"HTTP/1.1 200"))
}

/// Starts a streaming chat request from a socket with a 4 KiB receive buffer, then reads one
/// byte per second until `deadline`. Returns the bytes it read.
async fn slow_reader(h: Hostile, i: usize, deadline: Instant) -> usize {
    let Ok(socket) = TcpSocket::new_v4() else { return 0 };
    let _ = socket.set_recv_buffer_size(4096);
    let Ok(mut s) = socket.connect(h.addr).await else { return 0 };
    let body = serde_json::json!({
        "model": h.model,
        "messages": [{"role": "user", "content": format!("Write a long story about lighthouse number {i}.")}],
        "max_tokens": h.slow_tokens,
        "stream": true,
        "ignore_eos": true,
    })
    .to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: pd\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    if s.write_all(head.as_bytes()).await.is_err() || s.write_all(body.as_bytes()).await.is_err() {
        return 0;
    }
    let mut read = 0;
    let mut byte = [0u8; 1];
    while Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_secs(1), s.read(&mut byte)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(_)) => read += 1,
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    read
}
