//! pd-proto: the one crate that compiles `proto/pd/v1/*.proto` (tonic + prost, into OUT_DIR).
//! Every other crate uses the generated types from here.

/// Version 1 of pd's APIs.
pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("pd.v1");
}

/// Encoded file descriptors of every pd.v1 proto, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/pd_descriptor.bin"));
