//! Generates the gRPC code into OUT_DIR with protox (pure Rust; no protoc needed).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let files = [root.join("lane.proto"), root.join("control.proto")];
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let fds = protox::compile(&files, [&root])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
