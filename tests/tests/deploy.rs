//! The Kubernetes manifests agree with the binaries: every overlay renders with
//! `kubectl kustomize` and passes `kubernetes-validate --strict` (Kubernetes 1.32); every pd
//! container's args and environment are accepted by that binary's own flag parser
//! (`--check-config`); probe paths are served by the running binary on the port the probe
//! names; the router's worker lists name the headless services of the worker pools; and the
//! metrics the autoscalers query are ones the binaries export; where internal TLS is on
//! (overlays/gpu), every pd container reads its three PEM files from a mounted secret that a
//! cert-manager Certificate for the name the binaries verify (`pd.internal`) fills; each
//! overlay runs its own image (a CUDA build wherever a container asks for CUDA); and every pod
//! a NetworkPolicy guards or admits carries the labels it selects.
//!
//! Needs kubectl and kubernetes-validate (scripts/install-k8s-tools.sh).

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use pd_tests::k8s::run;
use pd_tests::Cluster;
use serde_json::Value;

const OVERLAYS: [&str; 4] = ["cpu-dev", "gpu", "gpu-rdma", "own-model"];
const KUBERNETES_VERSION: &str = "1.32.0";
/// The pd image each overlay deploys.
const IMAGES: [(&str, &str); 4] = [
    ("cpu-dev", "ghcr.io/pd-serving/pd:cpu-0.1.0"),
    ("gpu", "ghcr.io/pd-serving/pd:cuda-0.1.0"),
    ("gpu-rdma", "ghcr.io/pd-serving/pd:cuda-ucx-0.1.0"),
    ("own-model", "registry.example.com/pd:cpu-0.1.0"),
];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Renders `overlay`, validates it and returns its objects.
fn render(overlay: &str) -> Vec<Value> {
    let (file, objects) = pd_tests::k8s::render(overlay);
    let report = run(
        Command::new("kubernetes-validate").args(["-k", KUBERNETES_VERSION, "--strict", "--quiet"]).arg(file.path()),
        &format!("kubernetes-validate {overlay}"),
    );
    assert!(!report.contains("ERROR"), "{overlay}: {report}");
    objects
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// The port of a `host:port` listen flag in `args` (`--flag=value` form).
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter().find_map(|a| a.strip_prefix(&format!("--{name}=")))
}

fn port_of(addr: &str) -> u16 {
    addr.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or_else(|| panic!("no port in {addr}"))
}

/// A pd container of a Deployment, as the kubelet would start it.
struct PdContainer {
    deployment: String,
    binary: String,
    args: Vec<String>,
    env: HashMap<String, String>,
    container: Value,
    pod: Value,
}

fn pd_containers(objects: &[Value]) -> Vec<PdContainer> {
    let config = &find(objects, "ConfigMap", "pd-config")["data"];
    let mut out = Vec::new();
    for d in objects.iter().filter(|o| o["kind"] == "Deployment") {
        let pod = &d["spec"]["template"]["spec"];
        for c in pod["containers"].as_array().into_iter().flatten() {
            let Some(binary) = c["command"][0].as_str().filter(|b| b.starts_with("pd-")) else { continue };
            let mut env = HashMap::new();
            for from in c["envFrom"].as_array().into_iter().flatten() {
                assert_eq!(from["configMapRef"]["name"], "pd-config", "envFrom names an unknown ConfigMap");
                for (k, v) in config.as_object().into_iter().flatten() {
                    env.insert(k.clone(), v.as_str().unwrap_or_default().to_string());
                }
            }
            for e in c["env"].as_array().into_iter().flatten() {
                let name = e["name"].as_str().unwrap_or_default().to_string();
                let value = match (&e["value"], &e["valueFrom"]["fieldRef"]["fieldPath"]) {
                    (Value::String(v), _) => v.clone(),
                    (_, Value::String(path)) if path == "status.podIP" => "10.1.2.3".into(),
                    (_, Value::String(path)) if path == "metadata.name" => "pod-0".into(),
                    other => panic!("unsupported env source {other:?}"),
                };
                env.insert(name, value);
            }
            // The kubelet expands $(VAR) in args from the container's environment.
            let args = c["args"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|a| {
                    let mut a = a.as_str().expect("string arg").to_string();
                    for (k, v) in &env {
                        a = a.replace(&format!("$({k})"), v);
                    }
                    assert!(!a.contains("$("), "unexpanded variable in {a}");
                    a
                })
                .collect();
            out.push(PdContainer {
                deployment: d["metadata"]["name"].as_str().unwrap_or_default().to_string(),
                binary: binary.to_string(),
                args,
                env,
                container: c.clone(),
                pod: pod.clone(),
            });
        }
    }
    let binaries: BTreeSet<&str> = out.iter().map(|c| c.binary.as_str()).collect();
    assert_eq!(binaries, BTreeSet::from(["pd-decode", "pd-prefill", "pd-router"]));
    out
}

fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    exe.parent().and_then(Path::parent).expect("target dir").join(name)
}

/// The port a probe or annotation names, resolved through the container's named ports.
fn resolve_port(container: &Value, port: &Value) -> u16 {
    match port {
        Value::Number(n) => n.as_u64().expect("port") as u16,
        Value::String(s) => s.parse().unwrap_or_else(|_| {
            container["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|p| p["name"] == s.as_str())
                .and_then(|p| p["containerPort"].as_u64())
                .unwrap_or_else(|| panic!("no container port named {s}")) as u16
        }),
        other => panic!("bad port {other}"),
    }
}

/// `value` with a path under the TLS secret's mount moved to `dir`.
fn secret_path(value: &str, dir: &Path) -> String {
    match value.strip_prefix("/etc/pd/tls/") {
        Some(file) => dir.join(file).display().to_string(),
        None => value.to_string(),
    }
}

/// Whether `c` uses internal TLS; if it does, its PEM files come from a mounted secret that
/// a cert-manager Certificate for `pd.internal` (server and client use) fills.
fn check_tls(objects: &[Value], c: &PdContainer, overlay: &str) -> bool {
    let what = format!("{overlay}/{}", c.deployment);
    let vars = ["PD_TLS_CERT", "PD_TLS_KEY", "PD_TLS_CA"];
    let set: Vec<&str> = vars.iter().filter_map(|v| c.env.get(*v).map(String::as_str)).collect();
    if set.is_empty() {
        return false;
    }
    assert_eq!(set.len(), 3, "{what}: all of {vars:?} or none");
    for (var, path) in vars.iter().zip(&set) {
        let mount = c.container["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|m| m["mountPath"].as_str().is_some_and(|p| path.starts_with(&format!("{p}/"))))
            .unwrap_or_else(|| panic!("{what}: {var}={path} is on no mounted volume"));
        let volume = c.pod["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|v| v["name"] == mount["name"])
            .unwrap_or_else(|| panic!("{what}: no volume {}", mount["name"]));
        let secret =
            volume["secret"]["secretName"].as_str().unwrap_or_else(|| panic!("{what}: {var} not from a secret"));
        let file = path.rsplit('/').next().unwrap_or_default();
        assert!(["tls.crt", "tls.key", "ca.crt"].contains(&file), "{what}: {file} is not a cert-manager secret key");
        let cert = objects
            .iter()
            .find(|o| o["kind"] == "Certificate" && o["spec"]["secretName"] == secret)
            .unwrap_or_else(|| panic!("{what}: no Certificate fills secret {secret}"));
        assert!(
            cert["spec"]["dnsNames"].as_array().into_iter().flatten().any(|n| n == pd_proto::tls::SERVER_NAME),
            "{what}: the certificate must name {}",
            pd_proto::tls::SERVER_NAME
        );
        for usage in ["server auth", "client auth"] {
            assert!(cert["spec"]["usages"].as_array().into_iter().flatten().any(|u| u == usage), "{what}: {usage}");
        }
        let issuer = cert["spec"]["issuerRef"]["name"].as_str().expect("issuer");
        assert!(objects.iter().any(|o| o["kind"] == "Issuer" && o["metadata"]["name"] == issuer), "{what}: {issuer}");
    }
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifests_agree_with_the_binaries() {
    // The real binaries, for the paths and metrics they serve.
    let cluster = Cluster::start(1).await;
    let served = HashMap::from([
        ("pd-router", cluster.http.clone()),
        ("pd-prefill", cluster.prefill_metrics[0].clone()),
        ("pd-decode", cluster.decode_metrics.clone()),
    ]);
    // One request first, so that series which appear with their first event are there too.
    let answer = reqwest::Client::new()
        .post(cluster.url("/v1/completions"))
        .json(&serde_json::json!({"prompt": "Hello", "max_tokens": 2}))
        .send()
        .await
        .expect("request");
    assert!(answer.status().is_success(), "a request to the test cluster: {}", answer.status());
    let mut exported: HashMap<&str, String> = HashMap::new();
    for (bin, addr) in &served {
        exported.insert(bin, Cluster::scrape(addr).await);
    }
    // 0. Every metric a binary exports is in docs/metrics.md.
    let reference = std::fs::read_to_string(repo().join("docs/metrics.md")).expect("docs/metrics.md");
    for (bin, text) in &exported {
        for name in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).filter_map(|l| l.split(' ').next()) {
            assert!(reference.contains(&format!("| `{name}` |")), "{bin} exports {name}, which docs/metrics.md lacks");
        }
    }

    // The secret cert-manager would mount, made here: --check-config reads the PEM files.
    let secret = tempfile::tempdir().expect("folder");
    pd_tests::certs::make_certs(secret.path(), "tls");
    for (from, to) in [("tls.pem", "tls.crt"), ("tls-ca.pem", "ca.crt")] {
        std::fs::copy(secret.path().join(from), secret.path().join(to)).expect("copy");
    }
    for overlay in OVERLAYS {
        let objects = render(overlay);
        let containers = pd_containers(&objects);
        for c in &containers {
            let what = format!("{overlay}/{}", c.deployment);
            // 1. The binary's own parser accepts the args and environment.
            let out = Command::new(binary(&c.binary))
                .args(&c.args)
                .arg("--check-config")
                .env_clear()
                .envs(c.env.iter().map(|(k, v)| (k, secret_path(v, secret.path()))))
                .stdin(Stdio::null())
                .output()
                .expect("run binary");
            assert!(
                out.status.success(),
                "{what}: {} rejects its manifest args {:?}:\n{}",
                c.binary,
                c.args,
                String::from_utf8_lossy(&out.stderr)
            );
            // 2. Probes: on the binary's HTTP port, on paths it serves.
            let http_flag = if c.binary == "pd-router" { "http-listen" } else { "metrics-listen" };
            let http_port = port_of(flag(&c.args, http_flag).unwrap_or_else(|| panic!("{what}: no --{http_flag}")));
            for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
                let get = &c.container[probe]["httpGet"];
                assert!(get.is_object(), "{what}: {probe} must be an HTTP probe");
                assert_eq!(resolve_port(&c.container, &get["port"]), http_port, "{what}: {probe} port");
                let path = get["path"].as_str().expect("probe path");
                let status =
                    reqwest::get(format!("http://{}{path}", served[c.binary.as_str()])).await.expect("probe").status();
                assert!(
                    status.as_u16() == 200 || (path == "/ready" && status.as_u16() == 503),
                    "{what}: {path} answered {status}"
                );
            }
            let annotations = &objects
                .iter()
                .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == c.deployment.as_str())
                .expect("deployment")["spec"]["template"]["metadata"]["annotations"];
            assert_eq!(
                annotations["prometheus.io/port"].as_str().map(|p| p.parse::<u16>().ok()),
                Some(Some(http_port)),
                "{what}: scrape port"
            );
            assert_eq!(annotations["prometheus.io/path"], "/metrics");
            // 3. Graceful shutdown fits in the termination grace period.
            let pre_stop: u64 = c.container["lifecycle"]["preStop"]["exec"]["command"][1]
                .as_str()
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("{what}: preStop must be `sleep N`"));
            let drain_ms: u64 = match c.binary.as_str() {
                "pd-router" => flag(&c.args, "drain-delay-ms").and_then(|v| v.parse().ok()).unwrap_or(5_000),
                _ => flag(&c.args, "grace-ms").and_then(|v| v.parse().ok()).unwrap_or(30_000),
            };
            let period = c.pod["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
            assert!(
                period > pre_stop + drain_ms / 1000,
                "{what}: terminationGracePeriodSeconds {period} < preStop {pre_stop} s + drain {drain_ms} ms"
            );
        }
        // 4. Internal TLS: on in the production overlay, all or nothing per container.
        let tls = containers.iter().filter(|c| check_tls(&objects, c, overlay)).count();
        assert!(tls == 0 || tls == containers.len(), "{overlay}: TLS on some pd containers only");
        if overlay == "gpu" {
            assert_eq!(tls, containers.len(), "{overlay}: internal links must use mutual TLS");
        }
        // 5. The router's worker lists name the headless services of the pools, on the port
        //    the workers listen on, selecting the workers' pods.
        let router = containers.iter().find(|c| c.binary == "pd-router").expect("router");
        for (var, pool) in [("PD_PREFILL_WORKERS", "pd-prefill"), ("PD_DECODE_WORKERS", "pd-decode")] {
            let spec = router.env.get(var).unwrap_or_else(|| panic!("{overlay}: router has no {var}"));
            let (host, port) = spec.rsplit_once(':').expect("host:port");
            let service = find(&objects, "Service", host);
            assert_eq!(service["spec"]["clusterIP"], "None", "{overlay}: {host} must be headless");
            let worker = containers.iter().find(|c| c.binary == pool).expect("worker");
            assert_eq!(
                port_of(flag(&worker.args, "listen").expect("--listen")),
                port.parse::<u16>().expect("port"),
                "{overlay}: {var} port"
            );
            assert!(service["spec"]["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|p| p["port"].as_u64() == port.parse().ok()));
            let labels = &find(&objects, "Deployment", &worker.deployment)["spec"]["template"]["metadata"]["labels"];
            for (k, v) in service["spec"]["selector"].as_object().expect("selector") {
                assert_eq!(&labels[k], v, "{overlay}: {host} selects the {pool} pods");
            }
        }
        // 6. The image each pd container runs: the overlay's own (a base `images:` entry
        //    renames `pd` first, so an overlay must match the renamed image), and a CUDA build
        //    wherever a container asks for a CUDA device.
        let expected = IMAGES.iter().find(|(o, _)| *o == overlay).map(|(_, image)| *image).expect("overlay image");
        for c in &containers {
            let image = c.container["image"].as_str().expect("image");
            assert_eq!(image, expected, "{overlay}/{}: image", c.deployment);
            if c.args.iter().any(|a| a.starts_with("--device=cuda")) {
                assert!(image.contains(":cuda"), "{overlay}/{}: --device=cuda on {image}", c.deployment);
            }
        }
        // 7. Every pod a NetworkPolicy names (the pods it guards, the pods it admits) exists:
        //    a selector on a label no pod template carries admits nothing.
        let pods: Vec<&Value> = objects
            .iter()
            .filter(|o| o["kind"] == "Deployment")
            .map(|d| &d["spec"]["template"]["metadata"]["labels"])
            .collect();
        let selects = |selector: &Value| {
            let wanted = selector["matchLabels"].as_object().expect("matchLabels");
            pods.iter().any(|labels| wanted.iter().all(|(k, v)| &labels[k] == v))
        };
        for policy in objects.iter().filter(|o| o["kind"] == "NetworkPolicy") {
            let name = policy["metadata"]["name"].as_str().unwrap_or_default();
            assert!(selects(&policy["spec"]["podSelector"]), "{overlay}: NetworkPolicy {name} guards no pod");
            for rule in policy["spec"]["ingress"].as_array().into_iter().flatten() {
                for from in rule["from"].as_array().into_iter().flatten() {
                    if from["podSelector"].is_object() && from["namespaceSelector"].is_null() {
                        assert!(
                            selects(&from["podSelector"]),
                            "{overlay}: NetworkPolicy {name} admits {}, which no pod template carries",
                            from["podSelector"]
                        );
                    }
                }
            }
        }
        // 8. Every claim a pod mounts is in the render, in the pod's namespace, and the model
        //    path (PD_MODEL) lies on a volume every pd container mounts.
        for d in objects.iter().filter(|o| o["kind"] == "Deployment") {
            let namespace = &d["metadata"]["namespace"];
            for volume in d["spec"]["template"]["spec"]["volumes"].as_array().into_iter().flatten() {
                if let Some(claim) = volume["persistentVolumeClaim"]["claimName"].as_str() {
                    let pvc = find(&objects, "PersistentVolumeClaim", claim);
                    assert_eq!(&pvc["metadata"]["namespace"], namespace, "{overlay}: claim {claim}'s namespace");
                }
            }
        }
        for c in &containers {
            let model = c.env.get("PD_MODEL").unwrap_or_else(|| panic!("{overlay}/{}: no PD_MODEL", c.deployment));
            let mounted = c.container["volumeMounts"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|m| m["mountPath"].as_str())
                .any(|path| model.starts_with(&format!("{}/", path.trim_end_matches('/'))));
            assert!(mounted, "{overlay}/{}: PD_MODEL {model} is on no mounted volume", c.deployment);
        }
        // 9. Autoscalers: one per pool, on metrics that pool's binary exports.
        let scaled: Vec<&Value> = objects.iter().filter(|o| o["kind"] == "ScaledObject").collect();
        assert_eq!(scaled.len(), 3, "{overlay}: a ScaledObject per pool");
        for so in scaled {
            assert_eq!(so["apiVersion"], "keda.sh/v1alpha1");
            let target = so["spec"]["scaleTargetRef"]["name"].as_str().expect("target");
            let c = containers
                .iter()
                .find(|c| c.deployment == target)
                .unwrap_or_else(|| panic!("{target} is not a pd Deployment"));
            let (min, max) = (
                so["spec"]["minReplicaCount"].as_u64().expect("min"),
                so["spec"]["maxReplicaCount"].as_u64().expect("max"),
            );
            assert!(min >= 1 && min <= max, "{overlay}/{target}: replicas {min}..{max}");
            for trigger in so["spec"]["triggers"].as_array().expect("triggers") {
                match trigger["type"].as_str() {
                    Some("prometheus") => {
                        let query = trigger["metadata"]["query"].as_str().expect("query");
                        assert!(trigger["metadata"]["threshold"]
                            .as_str()
                            .and_then(|t| t.parse::<f64>().ok())
                            .is_some());
                        let names: Vec<&str> = query
                            .split(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_'))
                            .filter(|w| w.starts_with("pd_"))
                            .collect();
                        assert!(!names.is_empty(), "{query} uses no pd metric");
                        for name in names {
                            let text = &exported[c.binary.as_str()];
                            assert!(
                                text.lines().any(|l| l.starts_with(&format!("# TYPE {name} "))),
                                "{overlay}/{target}: {name} is not exported by {}",
                                c.binary
                            );
                        }
                    }
                    Some("cpu") => {
                        let cpu = &c.container["resources"]["requests"]["cpu"];
                        assert!(!cpu.is_null(), "{overlay}/{target}: a cpu trigger needs a cpu request");
                    }
                    other => panic!("{overlay}/{target}: unexpected trigger {other:?}"),
                }
            }
        }
    }
}

/// The images build with the toolchains the repository builds with: the workspace's
/// `rust-version`, and the CUDA major version of scripts/install-cuda-toolkit.sh. (That
/// `rust-version` really builds the workspace is what `deploy/containers/build-images.sh
/// in-image` shows: it compiles everything with exactly that toolchain.)
#[test]
fn images_build_with_the_repositorys_toolchains() {
    let read = |path: &str| std::fs::read_to_string(repo().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
    let manifest = read("Cargo.toml");
    let rust = manifest
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = \""))
        .and_then(|v| v.strip_suffix('"'))
        .expect("rust-version in Cargo.toml");
    let (cpu, cuda) = (read("deploy/docker/Dockerfile"), read("deploy/docker/Dockerfile.cuda"));
    assert!(cpu.contains(&format!("ARG RUST_IMAGE=rust:{rust}-")), "deploy/docker/Dockerfile: not Rust {rust}");
    assert!(cuda.contains(&format!("--default-toolchain {rust}.0")), "Dockerfile.cuda: not Rust {rust}");
    let major = |text: &str, prefix: &str| {
        text.lines().find_map(|l| l.trim().strip_prefix(prefix)).and_then(|v| v.split('.').next()).map(str::to_string)
    };
    let toolkit = major(&read("scripts/install-cuda-toolkit.sh"), "nvidia-cuda-nvcc==").expect("nvcc version");
    let image = major(&cuda, "ARG CUDA_VERSION=").expect("CUDA_VERSION in Dockerfile.cuda");
    assert_eq!(image, toolkit, "Dockerfile.cuda's CUDA major version");
}

/// docs/configuration.md lists every flag of each server binary as its own `--help` prints
/// it (scripts/gen-config-doc.sh writes it; rerun that after changing a flag).
#[test]
fn the_configuration_reference_is_the_binaries_own_help() {
    let doc = std::fs::read_to_string(repo().join("docs/configuration.md")).expect("docs/configuration.md");
    for name in ["pd-router", "pd-prefill", "pd-decode"] {
        let out = Command::new(binary(name)).arg("--help").env_clear().output().expect("run --help");
        assert!(out.status.success(), "{name} --help");
        let help = String::from_utf8(out.stdout).expect("utf-8 help");
        assert!(
            doc.contains(&format!("## {name}\n\n```text\n{help}```\n")),
            "docs/configuration.md is out of date for {name}: run scripts/gen-config-doc.sh"
        );
    }
}

/// The binaries that hold a model configure mimalloc before its first allocation
/// (`pd_engine::model_allocator!`): arenas committed on demand, so memory freed back to an
/// arena leaves RSS. mimalloc's verbose mode prints its options once they are read; the
/// environment still overrides the binaries' default.
#[test]
fn model_binaries_commit_allocator_arenas_on_demand() {
    let option = |name: &str, env: &[(&str, &str)]| -> String {
        let out = Command::new(binary(name))
            .arg("--help")
            .env_clear()
            .env("MIMALLOC_VERBOSE", "1")
            .envs(env.iter().copied())
            .output()
            .expect("run --help");
        assert!(out.status.success(), "{name} --help");
        let log = String::from_utf8_lossy(&out.stderr);
        log.lines()
            .find_map(|l| l.trim().strip_prefix("option 'arena_eager_commit': "))
            .unwrap_or_else(|| panic!("{name}: mimalloc printed no arena_eager_commit option:\n{log}"))
            .trim()
            .to_string()
    };
    for name in ["pd-prefill", "pd-decode", "pd-engine-bench"] {
        assert_eq!(option(name, &[]), "0", "{name}");
        assert_eq!(option(name, &[("MIMALLOC_ARENA_EAGER_COMMIT", "2")]), "2", "{name} with the variable set");
    }
}
