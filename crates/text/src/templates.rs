//! Chat templates of each family the loader supports, written for moelane in the layout of
//! each family's released template (not copied from one): what a synthetic or random
//! checkpoint of that family ships, so the gateway renders, parses and constrains that
//! family's own format (see [`crate::agent`]). `scripts/template_golden.py` renders them
//! through transformers' `apply_chat_template` machinery into `tests/golden/templates.json`;
//! `tests/template_golden.rs` checks that [`crate::chat`] renders them byte for byte alike.

/// Qwen3-MoE: ChatML, tools in the system turn, `<tool_call>` JSON, `<think>` reasoning.
pub const QWEN3_MOE: &str = include_str!("templates/qwen3_moe.jinja");
/// Qwen2-MoE: ChatML with a default system turn, `<tool_call>` JSON.
pub const QWEN2_MOE: &str = include_str!("templates/qwen2_moe.jinja");
/// Mixtral instruct: `[INST]` turns, no tools.
pub const MIXTRAL: &str = include_str!("templates/mixtral.jinja");
/// GLM-4.5: `<|user|>` turns, `<arg_key>`/`<arg_value>` calls, `<think>` reasoning.
pub const GLM4_MOE: &str = include_str!("templates/glm4_moe.jinja");
/// DeepSeek V3: `<｜User｜>` turns, `<｜tool▁calls▁begin｜>` calls.
pub const DEEPSEEK_V3: &str = include_str!("templates/deepseek_v3.jinja");
/// gpt-oss: harmony messages and channels.
pub const GPT_OSS: &str = include_str!("templates/gpt_oss.jinja");

/// Every family's template, by its config.json `model_type`.
pub const FAMILIES: [(&str, &str); 6] = [
    ("qwen3_moe", QWEN3_MOE),
    ("qwen2_moe", QWEN2_MOE),
    ("mixtral", MIXTRAL),
    ("glm4_moe", GLM4_MOE),
    ("deepseek_v3", DEEPSEEK_V3),
    ("gpt_oss", GPT_OSS),
];

/// The template of the family whose config.json `model_type` is `model_type`.
pub fn for_family(model_type: &str) -> Option<&'static str> {
    FAMILIES
        .iter()
        .find(|(f, _)| *f == model_type)
        .map(|(_, t)| *t)
}
