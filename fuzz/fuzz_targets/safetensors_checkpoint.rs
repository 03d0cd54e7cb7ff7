//! A checkpoint's safetensors file (header, offsets, dtypes, shapes) under a valid config:
//! opened and an expert read, never a panic or a read outside the file.
#![no_main]
use libfuzzer_sys::fuzz_target;

const CONFIG: &str = r#"{"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
  "hidden_size": 8, "intermediate_size": 16, "moe_intermediate_size": 4,
  "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
  "num_experts": 2, "num_experts_per_tok": 1, "vocab_size": 16, "max_position_embeddings": 64,
  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "decoder_sparse_step": 1,
  "norm_topk_prob": true, "tie_word_embeddings": false, "torch_dtype": "bfloat16"}"#;

fuzz_target!(|data: &[u8]| {
    let Ok(dir) = tempfile::tempdir() else { return };
    if std::fs::write(dir.path().join("config.json"), CONFIG).is_err()
        || std::fs::write(dir.path().join("model.safetensors"), data).is_err()
    {
        return;
    }
    if let Ok(ckpt) = moelane_engine::checkpoint::Checkpoint::open(dir.path()) {
        for e in 0..2 {
            let _ = ckpt.expert(0, e);
        }
        let _ = ckpt.tensor_bytes();
    }
});
