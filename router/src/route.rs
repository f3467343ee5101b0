//! The `route` stage: which decode worker holds the request's KV and streams its tokens, and
//! where its prompt is prefilled (a prefill worker, or the decode worker itself under
//! colocated serving and conditional disaggregation). The choice and its reasons go on the
//! `router.route` span and into the request's record.

use pd_proto::v1::decode_worker_client::DecodeWorkerClient;
use pd_proto::v1::prefill_worker_client::PrefillWorkerClient;
use tonic::transport::Channel;

use crate::error::RouterError;
use crate::record::RequestRecord;
use crate::workers::{Picked, Pools};

/// Where one request runs.
#[derive(Debug)]
pub struct Route {
    pub decode: Picked<DecodeWorkerClient<Channel>>,
    /// None: the decode worker prefills the prompt in its batch.
    pub prefill: Option<Picked<PrefillWorkerClient<Channel>>>,
}

/// Why a prompt is prefilled on the decode worker.
fn local_reason(pools: &Pools, prompt_tokens: usize) -> String {
    if pools.prefill.specs_empty() {
        "colocated: no prefill pool".to_string()
    } else {
        format!("short prompt: {prompt_tokens} <= {} tokens", pools.local_prefill_max_tokens)
    }
}

/// Chooses the workers for a prompt of `prompt_tokens` tokens.
pub async fn route(pools: &Pools, prompt_tokens: usize, record: &mut RequestRecord) -> Result<Route, RouterError> {
    let span = pd_telemetry::StageSpan::start("router.route", record.span().context());
    let here = pools.prefill_here(prompt_tokens);
    let picked = async {
        let decode = pools.pick_decode(&[]).await?;
        let prefill = if here { None } else { Some(pools.pick_prefill(&[]).await?) };
        Ok::<_, RouterError>(Route { decode, prefill })
    }
    .await;
    let route = match picked {
        Ok(r) => r,
        Err(e) => {
            span.error(e.to_string());
            return Err(e);
        }
    };
    span.set("pd.decode.worker", route.decode.addr.clone());
    span.set("pd.decode.why", route.decode.why.clone());
    record.decode_worker = route.decode.addr.clone();
    match &route.prefill {
        Some(p) => {
            span.set("pd.prefill.worker", p.addr.clone());
            span.set("pd.prefill.why", p.why.clone());
            record.prefill_worker = p.addr.clone();
        }
        None => {
            span.set("pd.prefill.worker", "decode worker");
            span.set("pd.prefill.why", local_reason(pools, prompt_tokens));
            record.prefill_worker = format!("local:{}", route.decode.addr);
        }
    }
    span.end();
    Ok(route)
}
