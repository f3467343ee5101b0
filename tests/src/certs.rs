//! Test certificates made with the openssl command: a CA and a certificate it signed for
//! `pd.internal` (the name every pd binary verifies), usable as server and client.

use std::path::Path;
use std::process::Command;

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").current_dir(dir).args(args).output().expect("the openssl command");
    assert!(out.status.success(), "openssl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
}

/// A CA (`{name}-ca.pem`) and a certificate for `pd.internal` it signed (`{name}.pem`,
/// `{name}.key`), usable as server and client.
pub fn make_certs(dir: &Path, name: &str) {
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    let ca_key = format!("{name}-ca.key");
    let ca = format!("{name}-ca.pem");
    let subject = format!("/CN={name} test CA");
    openssl(
        dir,
        &[&["req", "-x509"][..], &ec, &["-keyout", &ca_key, "-out", &ca, "-days", "2", "-subj", &subject]].concat(),
    );
    let (key, csr, cert) = (format!("{name}.key"), format!("{name}.csr"), format!("{name}.pem"));
    openssl(dir, &[&["req"][..], &ec, &["-keyout", &key, "-out", &csr, "-subj", "/CN=pd.internal"]].concat());
    let ext = format!("{name}.ext");
    std::fs::write(
        dir.join(&ext),
        "subjectAltName=DNS:pd.internal\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n",
    )
    .expect("extensions");
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-out",
            &cert,
            "-days",
            "2",
            "-extfile",
            &ext,
        ],
    );
}
