//! pd-otlp-sink: a minimal OTLP/gRPC trace receiver that counts what it is sent, so the cost
//! of trace export can be measured on a machine without Jaeger (export on vs off in one run:
//! see bench/results/tracing-overhead.md). Prints "pd-otlp-sink listening on ADDR", then a
//! line with the totals every `--report-s` seconds and on exit.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};

#[derive(Debug, Parser)]
struct Args {
    #[arg(long, default_value = "127.0.0.1:4317")]
    listen: String,
    #[arg(long, default_value_t = 10)]
    report_s: u64,
}

#[derive(Debug, Default, Clone)]
struct Counts {
    requests: Arc<AtomicU64>,
    spans: Arc<AtomicU64>,
}

#[tonic::async_trait]
impl TraceService for Counts {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans: usize =
            request.into_inner().resource_spans.iter().flat_map(|r| &r.scope_spans).map(|s| s.spans.len()).sum();
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.spans.fetch_add(spans as u64, Ordering::Relaxed);
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let listener = tokio::net::TcpListener::bind(&args.listen).await?;
    println!("pd-otlp-sink listening on {}", listener.local_addr()?);
    let counts = Counts::default();
    let reporter = counts.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(args.report_s)).await;
            println!(
                "exports {} spans {}",
                reporter.requests.load(Ordering::Relaxed),
                reporter.spans.load(Ordering::Relaxed)
            );
        }
    });
    let incoming = pd_proto::nodelay_incoming(listener);
    tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(counts.clone()))
        .serve_with_incoming_shutdown(incoming, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    println!("exports {} spans {}", counts.requests.load(Ordering::Relaxed), counts.spans.load(Ordering::Relaxed));
    Ok(())
}
