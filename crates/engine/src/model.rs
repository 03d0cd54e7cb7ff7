//! A model's weights as the step reads them: the dense weights of every decoder layer
//! (attention, norms, router, dense MLPs) and where they are read from ([`TensorSource`]:
//! a checkpoint, or tensors built in memory). The experts live in [`crate::bank`].

use crate::checkpoint::{Checkpoint, ExpertWeights};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::ops::Matrix;
/// One layer's multi-head latent attention (deepseek_v3), kept in the checkpoint's dtype,
/// `kv_b_proj` split per head so that attention runs on the cached latent (absorbed): the
/// query's nope part through each head's key rows (`uk_t`), the weighted latent through its
/// value rows (`uv`).
#[derive(Clone)]
pub struct MlaWeights {
    /// `q_a_proj [q_lora, H]` and `q_a_layernorm`, when q has a low-rank bottleneck.
    pub q_a: Option<(Matrix, Vec<f32>)>,
    /// `q_b_proj [heads * qk_head, q_lora]`, or `q_proj [heads * qk_head, H]`.
    pub q_b: Matrix,
    /// `kv_a_proj_with_mqa [kv_lora + rope, H]` and `kv_a_layernorm` (`[kv_lora]`).
    pub kv_a: Matrix,
    pub kv_a_norm: Vec<f32>,
    /// Per head: its key rows of `kv_b_proj`, transposed (`[kv_lora, nope]`).
    pub uk_t: Vec<Matrix>,
    /// Per head: its value rows of `kv_b_proj` (`[v_head, kv_lora]`).
    pub uv: Vec<Matrix>,
}

impl MlaWeights {
    fn bytes(&self) -> usize {
        let mut b = self.q_b.bytes() + self.kv_a.bytes() + self.kv_a_norm.len() * 4;
        b += self
            .q_a
            .as_ref()
            .map_or(0, |(m, n)| m.bytes() + n.len() * 4);
        b + self
            .uk_t
            .iter()
            .chain(&self.uv)
            .map(Matrix::bytes)
            .sum::<usize>()
    }
    fn vector_elements(&self) -> usize {
        self.kv_a_norm.len() + self.q_a.as_ref().map_or(0, |(_, n)| n.len())
    }

    fn load(ckpt: &impl TensorSource, p: &str) -> Result<Self> {
        let c = ckpt.config();
        let h = c.hidden_size;
        let m = c
            .mla
            .ok_or_else(|| crate::Error::Internal("MLA weights of a model without MLA".into()))?;
        let nh = c.num_attention_heads;
        let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
        let a = format!("{p}.self_attn");
        let (q_a, q_b) = match m.q_lora_rank {
            Some(r) => (
                Some((
                    ckpt.matrix(&format!("{a}.q_a_proj.weight"), r, h)?,
                    ckpt.tensor(&format!("{a}.q_a_layernorm.weight"), &[r])?,
                )),
                ckpt.matrix(&format!("{a}.q_b_proj.weight"), nh * qk, r)?,
            ),
            None => (
                None,
                ckpt.matrix(&format!("{a}.q_proj.weight"), nh * qk, h)?,
            ),
        };
        let r = m.kv_lora_rank;
        let kv_a = ckpt.matrix(
            &format!("{a}.kv_a_proj_with_mqa.weight"),
            r + m.qk_rope_head_dim,
            h,
        )?;
        let kv_a_norm = ckpt.tensor(&format!("{a}.kv_a_layernorm.weight"), &[r])?;
        let per = m.qk_nope_head_dim + m.v_head_dim;
        let kv_b = ckpt.matrix(&format!("{a}.kv_b_proj.weight"), nh * per, r)?;
        let (mut uk_t, mut uv) = (Vec::with_capacity(nh), Vec::with_capacity(nh));
        for hh in 0..nh {
            let k0 = hh * per;
            uk_t.push(kv_b.rows_of(k0, k0 + m.qk_nope_head_dim).transposed());
            uv.push(kv_b.rows_of(k0 + m.qk_nope_head_dim, k0 + per));
        }
        Ok(MlaWeights {
            q_a,
            q_b,
            kv_a,
            kv_a_norm,
            uk_t,
            uv,
        })
    }
}

/// Attention and norms of one decoder layer.
#[derive(Clone)]
pub struct LayerWeights {
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    /// q, k, v stacked: `[q_dim + 2 kv_dim, hidden]` (empty with MLA)
    pub qkv: Matrix,
    /// Multi-head latent attention's weights (deepseek_v3), in place of `qkv`.
    pub mla: Option<MlaWeights>,
    pub o: Matrix,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    /// q, k, v biases stacked (`q_dim + 2 kv_dim`); empty where the family has none.
    pub qkv_bias: Vec<f32>,
    /// The shared expert of a MoE layer (qwen2_moe, glm4_moe): its weights and its gate's row
    /// (`[H]`; empty when ungated, glm4_moe); every token goes through it beside its routed
    /// experts, always on the primary.
    pub shared: Option<(ExpertWeights, Vec<f32>)>,
    /// The router's correction bias (`e_score_correction_bias`, `[E]`), added to the scores
    /// the choice ranks (sigmoid routing); empty elsewhere.
    pub router_bias: Vec<f32>,
    /// `Some(router [E, H])` on MoE layers, else the dense MLP.
    pub router: Option<Matrix>,
    pub dense_mlp: Option<ExpertWeights>,
    /// The bias of the router's logits (`mlp.router.bias`, `[E]`, gpt_oss); empty elsewhere.
    pub router_logit_bias: Vec<f32>,
    /// The o projection's bias (`[H]`, gpt_oss); empty elsewhere.
    pub o_bias: Vec<f32>,
    /// Each head's attention sink logit (`self_attn.sinks`, `[heads]`, gpt_oss); empty
    /// elsewhere.
    pub sinks: Vec<f32>,
}

/// Everything but the experts.
#[derive(Clone)]
pub struct DenseWeights {
    pub embed: Matrix,
    pub layers: Vec<LayerWeights>,
    pub norm: Vec<f32>,
    /// `None` when tied to the embedding.
    pub lm_head: Option<Matrix>,
}

/// Where dense weights are read from: a checkpoint on disk, or tensors built in memory (the
/// `station` preset, whose weights never touch a file).
pub trait TensorSource {
    fn config(&self) -> &ModelConfig;
    /// A tensor as f32, checking its shape.
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>>;
    fn has(&self, name: &str) -> bool;
    /// The router of decoder layer `layer`.
    fn router_name(&self, layer: usize) -> String {
        format!("model.layers.{layer}.mlp.gate.weight")
    }
    /// A 2-D tensor, shape checked, in the dtype the source keeps it in.
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        Ok(Matrix::new(rows, cols, self.tensor(name, &[rows, cols])?))
    }
}

/// Says at load that a dense tensor of the checkpoint holds NaN or infinite values (as
/// transformers, the model still loads: its answers will be wrong, and this names why).
fn warn_non_finite(name: &str, bad: usize, of: usize) {
    if bad > 0 {
        eprintln!(
            "moelane: warning: tensor {name} holds {bad} NaN or infinite values (of {of}): \
             answers from this checkpoint will be wrong"
        );
    }
}

impl TensorSource for Checkpoint {
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let t = Checkpoint::tensor(self, name, shape)?;
        warn_non_finite(name, t.iter().filter(|x| !x.is_finite()).count(), t.len());
        Ok(t)
    }
    fn has(&self, name: &str) -> bool {
        Checkpoint::has(self, name)
    }
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let m = Checkpoint::matrix(self, name, rows, cols)?;
        warn_non_finite(name, m.data.non_finite(), m.data.len());
        Ok(m)
    }
    fn router_name(&self, layer: usize) -> String {
        Checkpoint::router_name(self, layer)
    }
}

impl DenseWeights {
    pub fn load(ckpt: &impl TensorSource) -> Result<Self> {
        let c = ckpt.config();
        let h = c.hidden_size;
        let embed = ckpt.matrix("model.embed_tokens.weight", c.vocab_size, h)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let (qkv, mla) = if c.mla.is_some() {
                (Matrix::zeros(0, h), Some(MlaWeights::load(ckpt, &p)?))
            } else {
                let qkv = Matrix::stack(&[
                    ckpt.matrix(&format!("{p}.self_attn.q_proj.weight"), c.q_dim(), h)?,
                    ckpt.matrix(&format!("{p}.self_attn.k_proj.weight"), c.kv_dim(), h)?,
                    ckpt.matrix(&format!("{p}.self_attn.v_proj.weight"), c.kv_dim(), h)?,
                ]);
                (qkv, None)
            };
            // empty where the family has no q/k norm
            let qk_norm = |n: &str| -> Result<Vec<f32>> {
                if c.qk_norm {
                    ckpt.tensor(&format!("{p}.self_attn.{n}.weight"), &[c.head_dim])
                } else {
                    Ok(Vec::new())
                }
            };
            let qkv_bias = if c.qkv_bias {
                let mut b = ckpt.tensor(&format!("{p}.self_attn.q_proj.bias"), &[c.q_dim()])?;
                b.extend(ckpt.tensor(&format!("{p}.self_attn.k_proj.bias"), &[c.kv_dim()])?);
                b.extend(ckpt.tensor(&format!("{p}.self_attn.v_proj.bias"), &[c.kv_dim()])?);
                b
            } else {
                Vec::new()
            };
            let si = c.shared_expert_intermediate_size;
            let shared = if c.is_moe_layer(l) && si > 0 {
                let s = if c.shared_expert_gated {
                    format!("{p}.mlp.shared_expert")
                } else {
                    format!("{p}.mlp.shared_experts")
                };
                let gate = if c.shared_expert_gated {
                    ckpt.tensor(&format!("{p}.mlp.shared_expert_gate.weight"), &[1, h])?
                } else {
                    Vec::new()
                };
                Some((
                    ExpertWeights::new(
                        Matrix::stack(&[
                            ckpt.matrix(&format!("{s}.gate_proj.weight"), si, h)?,
                            ckpt.matrix(&format!("{s}.up_proj.weight"), si, h)?,
                        ]),
                        ckpt.matrix(&format!("{s}.down_proj.weight"), h, si)?,
                        0,
                    ),
                    gate,
                ))
            } else {
                None
            };
            let router_bias = match c.routing {
                crate::config::Routing::SigmoidGrouped { .. } if c.is_moe_layer(l) => ckpt.tensor(
                    &format!("{p}.mlp.gate.e_score_correction_bias"),
                    &[c.num_experts],
                )?,
                _ => Vec::new(),
            };
            let (router, dense_mlp) = if c.is_moe_layer(l) {
                (
                    Some(ckpt.matrix(&ckpt.router_name(l), c.num_experts, h)?),
                    None,
                )
            } else {
                let i = c.intermediate_size;
                let gate_up = Matrix::stack(&[
                    ckpt.matrix(&format!("{p}.mlp.gate_proj.weight"), i, h)?,
                    ckpt.matrix(&format!("{p}.mlp.up_proj.weight"), i, h)?,
                ]);
                let down = ckpt.matrix(&format!("{p}.mlp.down_proj.weight"), h, i)?;
                (None, Some(ExpertWeights::new(gate_up, down, 0)))
            };
            let a = format!("{p}.self_attn");
            let vector = |on: bool, name: String, n: usize| -> Result<Vec<f32>> {
                if on {
                    ckpt.tensor(&name, &[n])
                } else {
                    Ok(Vec::new())
                }
            };
            let router_logit_bias = vector(
                c.router_logit_bias && c.is_moe_layer(l),
                format!("{p}.mlp.router.bias"),
                c.num_experts,
            )?;
            let o_bias = vector(c.o_bias, format!("{a}.o_proj.bias"), h)?;
            let sinks = vector(
                c.attention_sinks,
                format!("{a}.sinks"),
                c.num_attention_heads,
            )?;
            layers.push(LayerWeights {
                input_norm: ckpt.tensor(&format!("{p}.input_layernorm.weight"), &[h])?,
                post_norm: ckpt.tensor(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                qkv,
                o: ckpt.matrix(&format!("{p}.self_attn.o_proj.weight"), h, c.o_dim())?,
                mla,
                q_norm: qk_norm("q_norm")?,
                k_norm: qk_norm("k_norm")?,
                router,
                dense_mlp,
                qkv_bias,
                shared,
                router_bias,
                router_logit_bias,
                o_bias,
                sinks,
            });
        }
        let norm = ckpt.tensor("model.norm.weight", &[h])?;
        // tied: the embedding is the head, whatever `lm_head.weight` the checkpoint also holds
        // (transformers ties it over the stored one, vLLM skips it)
        let lm_head = if !c.tie_word_embeddings {
            Some(ckpt.matrix("lm_head.weight", c.vocab_size, h)?)
        } else {
            None
        };
        Ok(DenseWeights {
            embed,
            layers,
            norm,
            lm_head,
        })
    }

    /// Bytes of every dense weight held (norm vectors and biases as f32, matrices in their
    /// stored dtype).
    pub fn bytes(&self) -> usize {
        let v = |x: &Vec<f32>| x.len() * 4;
        let mut b = self.embed.bytes() + v(&self.norm);
        b += self.lm_head.as_ref().map_or(0, |m| m.bytes());
        for l in &self.layers {
            b += l.qkv.bytes() + l.o.bytes() + v(&l.input_norm) + v(&l.post_norm);
            b += v(&l.q_norm) + v(&l.k_norm) + v(&l.qkv_bias) + v(&l.router_bias);
            b += v(&l.router_logit_bias) + v(&l.o_bias) + v(&l.sinks);
            b += l.mla.as_ref().map_or(0, MlaWeights::bytes);
            b += l.router.as_ref().map_or(0, |r| r.bytes());
            b += l.dense_mlp.as_ref().map_or(0, |m| m.bytes());
            b += l.shared.as_ref().map_or(0, |(m, g)| m.bytes() + v(g));
        }
        b
    }

    /// The elements held as f32 vectors (norms, biases, the shared expert's gate): the only
    /// weights widened from the checkpoint's dtype.
    pub fn vector_elements(&self) -> usize {
        let mut n = self.norm.len();
        for l in &self.layers {
            n += l.input_norm.len() + l.post_norm.len() + l.q_norm.len() + l.k_norm.len();
            n += l.qkv_bias.len() + l.shared.as_ref().map_or(0, |(_, g)| g.len());
            n += l.router_bias.len() + l.router_logit_bias.len() + l.o_bias.len() + l.sinks.len();
            n += l.mla.as_ref().map_or(0, MlaWeights::vector_elements);
        }
        n
    }

    /// Bytes of dense weights one decode token reads (all but the embedding table: one row),
    /// in their stored dtypes.
    pub fn bytes_per_token(&self) -> usize {
        let mut b = self.embed.cols * self.embed.data.size() + self.norm.len() * 4;
        for l in &self.layers {
            b += l.qkv.bytes() + l.o.bytes() + (l.input_norm.len() + l.post_norm.len()) * 4;
            b += l.mla.as_ref().map_or(0, MlaWeights::bytes);
            b += l.router.as_ref().map_or(0, |r| r.bytes());
            b += l.dense_mlp.as_ref().map_or(0, |m| m.bytes());
            b += l
                .shared
                .as_ref()
                .map_or(0, |(m, g)| m.bytes() + g.len() * 4);
            b += (l.qkv_bias.len() + l.router_bias.len() + l.router_logit_bias.len()) * 4;
            b += (l.o_bias.len() + l.sinks.len()) * 4;
        }
        b + self.lm_head.as_ref().unwrap_or(&self.embed).bytes()
    }
}
