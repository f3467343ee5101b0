//! The `route` stage: the scheduler's grant (which decode worker holds the request's KV and
//! streams its tokens, and where its prompt is prefilled: a prefill worker, or the decode
//! worker itself under colocated serving and conditional disaggregation) becomes clients.
//! The choice and its reasons go on the `router.route` span, into the request's record and
//! into `pd_route_decisions_total{where,reason}`.

use pd_proto::v1::decode_worker_client::DecodeWorkerClient;
use pd_proto::v1::prefill_worker_client::PrefillWorkerClient;
use pd_telemetry::metrics::RouterMetrics;
use tonic::transport::Channel;

use crate::error::RouterError;
use crate::record::RequestRecord;
use crate::schedule::{Grant, Placement, Ticket};
use crate::workers::{Picked, Pools};

/// Where one request runs, and the capacity it holds there.
#[derive(Debug)]
pub struct Route {
    pub decode: Picked<DecodeWorkerClient<Channel>>,
    /// None: the decode worker prefills the prompt in its batch.
    pub prefill: Option<Picked<PrefillWorkerClient<Channel>>>,
    pub ticket: Ticket,
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Turns `grant` into clients and records the decision.
pub fn route(
    pools: &Pools,
    grant: Grant,
    metrics: &RouterMetrics,
    record: &mut RequestRecord,
) -> Result<Route, RouterError> {
    let span = pd_telemetry::StageSpan::start("router.route", record.span().context());
    let Grant { placement, ticket } = grant;
    let Placement { decode, prefill, place, waited, prefill_wait, decode_cached, prefill_cached, .. } = placement;
    let wait_ms = prefill_wait.map_or(-1.0, ms);
    span.set("pd.route.where", place.where_label());
    span.set("pd.route.reason", place.reason());
    span.set("pd.route.queue_ms", ms(waited));
    span.set("pd.route.prefill_wait_estimate_ms", wait_ms);
    span.set("pd.route.decode_cached_tokens", decode_cached as i64);
    span.set("pd.route.prefill_cached_tokens", prefill_cached as i64);
    metrics.route_decisions.with_label_values(&[place.where_label(), place.reason()]).inc();
    let why_decode = format!("least load with room, {decode_cached} prompt tokens cached");
    let picked = pools.decode_client(&decode, why_decode).and_then(|d| {
        let p = match &prefill {
            Some(addr) => Some(pools.prefill_client(
                addr,
                format!("soonest first token: {wait_ms:.0} ms wait, {prefill_cached} prompt tokens cached"),
            )?),
            None => None,
        };
        Ok((d, p))
    });
    let (decode, prefill) = match picked {
        Ok(p) => p,
        Err(e) => {
            span.error(e.to_string());
            return Err(e);
        }
    };
    span.set("pd.decode.worker", decode.addr.clone());
    record.route_cached = (decode_cached, prefill_cached);
    record.decode_worker = decode.addr.clone();
    match &prefill {
        Some(p) => {
            span.set("pd.prefill.worker", p.addr.clone());
            record.prefill_worker = p.addr.clone();
        }
        None => {
            span.set("pd.prefill.worker", "decode worker");
            record.prefill_worker = format!("local:{}", decode.addr);
        }
    }
    span.end();
    Ok(Route { decode, prefill, ticket })
}
