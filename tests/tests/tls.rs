//! Mutual TLS on the internal links with the real binaries: with `PD_TLS_CERT`, `PD_TLS_KEY`
//! and `PD_TLS_CA` set, the router reaches the workers and the prefill worker ships KV to the
//! decode worker over TLS (a request is answered, its KV bytes counted), while a client with
//! no certificate, with a certificate from another CA, or in plaintext is refused by a worker.
//! Certificates are made by the test with the openssl command.

use std::time::Duration;

use pd_proto::v1 as pb;
use pd_tests::certs::make_certs;
use pd_tests::{Cluster, Options};
use serde_json::json;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// The decode worker's load over a channel with `tls` (None: plaintext).
async fn load(addr: &str, tls: Option<ClientTlsConfig>) -> Result<pb::DecodeLoad, String> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}")).map_err(|e| e.to_string())?;
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls).map_err(|e| e.to_string())?;
    }
    let channel = endpoint.connect_timeout(Duration::from_secs(3)).connect().await.map_err(|e| format!("{e:?}"))?;
    let mut client = pb::decode_worker_client::DecodeWorkerClient::new(channel);
    let call = client.load(pb::LoadRequest::default());
    match tokio::time::timeout(Duration::from_secs(5), call).await {
        Ok(r) => r.map(|r| r.into_inner()).map_err(|s| s.to_string()),
        Err(_) => Err("timed out".into()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn internal_links_need_a_certificate_from_the_cluster_ca() {
    let dir = tempfile::tempdir().expect("dir");
    make_certs(dir.path(), "pd");
    make_certs(dir.path(), "rogue");
    let file = |n: &str| dir.path().join(n).to_string_lossy().into_owned();
    let env = vec![
        ("PD_TLS_CERT".to_string(), file("pd.pem")),
        ("PD_TLS_KEY".to_string(), file("pd.key")),
        ("PD_TLS_CA".to_string(), file("pd-ca.pem")),
    ];
    let cluster = Cluster::start_with(Options { prefill: 1, env, ..Options::default() }).await;

    // The cluster works over its TLS links: the router found its workers ready, and a
    // request goes router -> prefill -> (KV) -> decode.
    let body = json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0});
    let r = reqwest::Client::new().post(cluster.url("/v1/completions")).json(&body).send().await.expect("post");
    assert_eq!(r.status().as_u16(), 200, "{}", r.text().await.unwrap_or_default());
    let metrics = Cluster::scrape(&cluster.decode_metrics).await;
    let kv_bytes: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("pd_kv_transfer_bytes_total "))
        .and_then(|v| v.parse().ok())
        .expect("kv bytes counter");
    assert!(kv_bytes > 0.0, "the KV crossed the TLS link");

    let pem = |n: &str| std::fs::read(dir.path().join(n)).expect("pem");
    let ca = Certificate::from_pem(pem("pd-ca.pem"));
    let ours = Identity::from_pem(pem("pd.pem"), pem("pd.key"));
    let rogue = Identity::from_pem(pem("rogue.pem"), pem("rogue.key"));
    let tls = |identity: Option<Identity>| {
        let c = ClientTlsConfig::new().ca_certificate(ca.clone()).domain_name(pd_proto::tls::SERVER_NAME);
        Some(match identity {
            Some(i) => c.identity(i),
            None => c,
        })
    };
    let addr = cluster.decode_addr.clone();
    assert!(load(&addr, tls(Some(ours))).await.is_ok(), "a client with a cluster certificate is served");
    let refused = [
        ("plaintext", load(&addr, None).await),
        ("no client certificate", load(&addr, tls(None)).await),
        ("a certificate from another CA", load(&addr, tls(Some(rogue))).await),
    ];
    for (what, outcome) in refused {
        assert!(outcome.is_err(), "a client with {what} was served: {outcome:?}");
    }
}
