//! moelane-engine: the model math of a lane. Loads Hugging Face `qwen3_moe`, `mixtral`,
//! `qwen2_moe`, `glm4_moe` and `deepseek_v3` checkpoints (weights in their stored dtype),
//! runs them on the CPU backend with a paged KV cache, splits experts between a hot and a
//! cold tier by a rowmap, and makes synthetic checkpoints whose routing is structured by
//! language. Knows nothing of gRPC or HTTP.

pub mod bank;
pub mod bpe;
pub mod checkpoint;
pub mod config;
pub mod cpu;
pub mod error;
pub mod figures;
pub mod hostmem;
pub mod kv;
pub mod load;
pub mod model;
pub mod numa;
pub mod ops;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[macro_use]
mod ops_tiles;
#[cfg(target_arch = "aarch64")]
mod ops_arm;
#[cfg(target_arch = "x86_64")]
mod ops_x86;
pub mod placement;
pub mod predict;
pub mod progress;
pub mod random_ckpt;
pub mod rng;
pub mod rowmap;
pub mod sampling;
pub mod step;
pub mod swap;
pub mod synth;
pub mod team;
pub mod tier;

pub use error::{Error, Result};

/// The tokenizer lives in `moelane-text` (shared with the gateway).
pub use moelane_text::tokenizer;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod cuda_experts;
#[cfg(feature = "cuda")]
pub mod cuda_link;
#[cfg(feature = "cuda")]
pub mod cuda_model;
#[cfg(feature = "cuda")]
pub mod cuda_station;
pub mod gpu;
