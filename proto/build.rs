//! Compiles every pd.v1 proto once, into OUT_DIR.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["pd/v1/kv_transfer.proto", "pd/v1/worker.proto"];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    tonic_prost_build::configure().compile_protos(&protos, &["."])?;
    Ok(())
}
