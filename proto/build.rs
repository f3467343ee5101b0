//! Compiles every pd.v1 proto once, into OUT_DIR.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["pd/v1/logprobs.proto", "pd/v1/kv_transfer.proto", "pd/v1/worker.proto", "pd/v1/generation.proto"];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let descriptor = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("pd_descriptor.bin");
    tonic_prost_build::configure().file_descriptor_set_path(&descriptor).compile_protos(&protos, &["."])?;
    Ok(())
}
