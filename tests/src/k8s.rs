//! The Kubernetes manifests as the tests read them: an overlay rendered with `kubectl
//! kustomize` (scripts/install-k8s-tools.sh installs kubectl and PyYAML), as a YAML file and
//! as JSON objects.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

/// Runs `cmd`; its stdout, or a panic naming `what` with its output.
pub fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e} (run scripts/install-k8s-tools.sh)"));
    assert!(
        out.status.success(),
        "{what} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `deploy/k8s/overlays/<overlay>` rendered: the YAML (in a temporary file) and its objects.
pub fn render(overlay: &str) -> (tempfile::NamedTempFile, Vec<Value>) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/k8s/overlays").join(overlay);
    let yaml = run(Command::new("kubectl").arg("kustomize").arg(&dir), &format!("kubectl kustomize {overlay}"));
    let file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(file.path(), &yaml).expect("write render");
    let json = run(
        Command::new("python3")
            .args([
                "-c",
                "import json, sys, yaml; print(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d]))",
            ])
            .arg(file.path()),
        "yaml to json",
    );
    (file, serde_json::from_str(&json).expect("render as json"))
}
