//! Hugging Face checkpoints on disk: `config.json`, one or many `*.safetensors` files
//! (with `model.safetensors.index.json`), memory-mapped; bf16, f16 and f32 tensors, kept in
//! their own dtype in memory ([`crate::ops::Elems`]).
//!
//! Expert tensors are accepted in every layout checkpoints use: one tensor per expert
//! (`mlp.experts.{e}.gate_proj.weight`, qwen3_moe on the hub; `block_sparse_moe.experts.{e}.w1`
//! / `w3` / `w2`, mixtral as released) and the fused per-layer tensors that recent
//! `transformers` writes (`mlp.experts.gate_up_proj` `[E, 2I, H]`, `mlp.experts.down_proj`
//! `[E, H, I]`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata};
use sha2::{Digest, Sha256};

use crate::config::{Family, Fp8Scales, Glu, ModelConfig};
use crate::error::{Error, Result};
use crate::ops::{Bf16, BlockScaled, Elems, Matrix, F16, F8};
use moelane_text::files::{read_bounded_text, CONFIG_LIMIT, VOCAB_LIMIT};

struct ShardFile {
    path: PathBuf,
    map: Mmap,
    header_len: usize,
    meta: Metadata,
}

/// An opened checkpoint directory. Tensors are read from the mappings on demand.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: ModelConfig,
    /// `<model_type>-<16 hex of sha256(config.json)>`: what a rowmap's `model` must say.
    pub id: String,
    files: Vec<ShardFile>,
    /// tensor name -> index into `files`
    index: HashMap<String, usize>,
}

/// A view of one tensor's raw bytes.
pub struct RawTensor<'a> {
    pub file: &'a Path,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

/// A checkpoint's id: its family and the first 8 bytes of its config.json's SHA-256.
fn id_of(config: &ModelConfig, cfg_text: &str) -> String {
    let digest = Sha256::digest(cfg_text.as_bytes());
    format!(
        "{}-{}",
        config.family.name(),
        digest[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    )
}

fn open_shard(path: &Path) -> Result<ShardFile> {
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: the file is opened read-only; moelane never writes checkpoints it has mapped
    // (a truncation by another process while mapped is outside what we can defend against).
    let map = unsafe { Mmap::map(&f) }.map_err(|e| Error::io(path, e))?;
    let bad = |reason: String| Error::BadSafetensors {
        file: path.into(),
        reason,
    };
    if map.len() < 8 {
        return Err(bad(format!("truncated: {} bytes, no header", map.len())));
    }
    let mut n8 = [0u8; 8];
    n8.copy_from_slice(&map[..8]);
    let header_len = u64::from_le_bytes(n8) as usize;
    if header_len > map.len() - 8 {
        return Err(bad(format!(
            "truncated: header says {} bytes of JSON, file has {} bytes",
            header_len,
            map.len()
        )));
    }
    let meta = match safetensors::SafeTensors::read_metadata(&map[..]) {
        Ok((_, meta)) => meta,
        Err(e) => {
            let reason = match e {
                safetensors::SafeTensorError::MetadataIncompleteBuffer => format!(
                    "truncated: the header describes more data than the file's {} bytes",
                    map.len()
                ),
                other => other.to_string(),
            };
            return Err(bad(reason));
        }
    };
    Ok(ShardFile {
        path: path.into(),
        map,
        header_len,
        meta,
    })
}

fn dtype_size(d: Dtype) -> Option<usize> {
    match d {
        Dtype::F8_E4M3 => Some(1),
        Dtype::BF16 | Dtype::F16 => Some(2),
        Dtype::F32 => Some(4),
        _ => None,
    }
}

/// Raw little-endian bf16/f16/f32 bytes as elements of their own dtype (no widening); FP8
/// bytes need their scales ([`Checkpoint::matrix`]) and are not read here.
pub fn elems(dtype: Dtype, bytes: &[u8]) -> Elems {
    let u16s = || {
        bytes
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
    };
    match dtype {
        Dtype::BF16 => Elems::Bf16(u16s().map(Bf16).collect()),
        Dtype::F16 => Elems::F16(u16s().map(F16).collect()),
        _ => Elems::F32(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
    }
}

/// One expert's weights: `gate_up` is `[2I, H]` (gate rows, then up rows), `down` is `[H, I]`;
/// gpt_oss's experts also have biases and their own activation.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertWeights {
    pub gate_up: Matrix,
    pub down: Matrix,
    /// The gate/up projection's bias (`[2I]`, gate then up) and the down projection's
    /// (`[H]`), as f32; empty where the family has none.
    pub gate_up_bias: Vec<f32>,
    pub down_bias: Vec<f32>,
    /// The activation between the projections.
    pub glu: Glu,
    /// [`ExpertBytes::checksum`] of the expert's bytes as stored in the checkpoint.
    pub checksum: u64,
}

/// An FP8 tensor's scales as stored (`weight_scale_inv`, or compressed-tensors'
/// `weight_scale`): their dtype and bytes.
type RawScales<'a> = (Dtype, &'a [u8]);

/// How an expert's tensors are laid out in the checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertLayout {
    /// Gate and up `[I, H]`, down `[H, I]`: one row per output (qwen3_moe, mixtral, ...).
    Rows,
    /// gpt_oss in bf16: `gate_up [H, 2I]` and `down [I, H]`, one column per output, the gate
    /// and up columns interleaved.
    Columns,
    /// gpt_oss as released: MXFP4 (`*_blocks`, two e2m1 values per byte, and `*_scales`, one
    /// e8m0 exponent per 32 values), one row per output, the gate and up rows interleaved;
    /// widened to bf16 (exactly) when loaded.
    Mxfp4,
}

/// One expert's tensors as stored in the checkpoint (views into the mapped files), with their
/// dtypes. [`ExpertLayout::Rows`]: the gate and up projections, then the down projection; for
/// FP8 weights, each one's `weight_scale_inv` (gate, up, down). [`ExpertLayout::Columns`]:
/// the whole gate_up in the first part (the second empty). [`ExpertLayout::Mxfp4`]: the
/// blocks as the parts, the exponents as the gate's and the down's scales.
pub struct ExpertBytes<'a> {
    pub layout: ExpertLayout,
    pub gate_up: [(Dtype, &'a [u8]); 2],
    pub down: (Dtype, &'a [u8]),
    pub scales: [Option<(Dtype, &'a [u8])>; 3],
    /// The f32 scales the expert is held with where that is not what `scales` store
    /// (compressed-tensors' scale per row or per tensor, repeated per block of 1 x 128).
    pub scales_held: Option<usize>,
    /// The biases of gate_up and down (gpt_oss).
    pub bias: Option<[(Dtype, &'a [u8]); 2]>,
}

impl ExpertBytes<'_> {
    /// The expert's checksum: [`checksum`] over gate, up and down in that order, then their
    /// scales where they have them, then their biases. The same bytes give the same checksum
    /// in either tensor layout.
    pub fn checksum(&self) -> u64 {
        let mut parts = vec![self.gate_up[0].1, self.gate_up[1].1, self.down.1];
        parts.extend(self.scales.iter().flatten().map(|(_, b)| *b));
        parts.extend(self.bias.iter().flatten().map(|(_, b)| *b));
        checksum(&parts)
    }

    /// The bytes the expert takes in memory once loaded: its stored bytes (FP8 scales and
    /// biases as f32); MXFP4 widened to bf16.
    pub fn stored(&self) -> usize {
        let f32s = |(d, b): &(Dtype, &[u8])| b.len() / dtype_size(*d).unwrap_or(4) * 4;
        let bias: usize = self.bias.iter().flatten().map(f32s).sum();
        let weights = self.gate_up[0].1.len() + self.gate_up[1].1.len() + self.down.1.len();
        if self.layout == ExpertLayout::Mxfp4 {
            // two values a byte, two bytes a value once widened
            return 4 * weights + bias;
        }
        let scales: usize = match self.scales_held {
            Some(n) => 4 * n,
            None => self.scales.iter().flatten().map(f32s).sum(),
        };
        weights + scales + bias
    }
}

/// Expert `e`'s share of fused tensor `t` (`raw`, experts along its first dimension, `ne` of
/// them); FP8 is refused, saying `fp8`.
fn expert_share<'a>(
    raw: RawTensor<'a>,
    t: &str,
    e: usize,
    ne: usize,
    fp8: &str,
) -> Result<(Dtype, &'a [u8])> {
    if raw.dtype == Dtype::F8_E4M3 {
        return Err(Error::WrongDtype {
            file: raw.file.into(),
            tensor: t.into(),
            found: fp8.into(),
        });
    }
    if e >= ne {
        return Err(Error::MissingTensor {
            tensor: format!("{t}[{e}]"),
            looked_in: raw.file.display().to_string(),
        });
    }
    let sz = raw.bytes.len() / ne;
    Ok((raw.dtype, &raw.bytes[e * sz..(e + 1) * sz]))
}

/// The 16 values of an e2m1 (FP4) code.
const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// MXFP4 `blocks` (two e2m1 codes per byte, the low nibble first) with one e8m0 exponent of
/// `scales` per 32 values, as bf16: each value is its code's times 2^(exponent - 127), exact in
/// bf16 (a 2-bit mantissa) wherever it does not overflow.
pub fn mxfp4_to_bf16(blocks: &[u8], scales: &[u8]) -> Vec<Bf16> {
    let mut out = Vec::with_capacity(blocks.len() * 2);
    for (chunk, &s) in blocks.chunks(16).zip(scales) {
        let m = 2f32.powi(s as i32 - 127);
        for &b in chunk {
            for code in [b & 0x0f, b >> 4] {
                let v = E2M1[code as usize] * m;
                out.push(Bf16((v.to_bits() >> 16) as u16));
            }
        }
    }
    out
}

/// The checksum of a sequence of byte slices, as if concatenated: rapidhash V3 (a fast
/// non-cryptographic hash, several GB/s per core, whose output is fixed across crate versions
/// and platforms) with its default secrets. It guards against a checkpoint that changed or
/// was damaged under a running lane (the swap protocol's PREPARE verifies every expert it
/// loads against the manifest taken at start), not against tampering.
pub fn checksum(parts: &[&[u8]]) -> u64 {
    let mut h = rapidhash::v3::RapidStreamHasherV3::new(&rapidhash::v3::DEFAULT_RAPID_SECRETS);
    for p in parts {
        h.write(p);
    }
    h.finish()
}

impl ExpertWeights {
    /// A SwiGLU expert without biases.
    pub fn new(gate_up: Matrix, down: Matrix, checksum: u64) -> Self {
        ExpertWeights {
            gate_up,
            down,
            gate_up_bias: Vec::new(),
            down_bias: Vec::new(),
            glu: Glu::Silu,
            checksum,
        }
    }

    pub fn bytes(&self) -> usize {
        self.gate_up.bytes()
            + self.down.bytes()
            + 4 * (self.gate_up_bias.len() + self.down_bias.len())
    }
}

impl Checkpoint {
    /// The id of the checkpoint in `dir` (as [`Checkpoint::open`] gives it) from its
    /// config.json alone: what a gateway, which may hold no weights, checks its lanes by.
    pub fn id_in(dir: &Path) -> Result<String> {
        let cfg_path = dir.join("config.json");
        let cfg_text =
            read_bounded_text(&cfg_path, CONFIG_LIMIT).map_err(|e| Error::io(&cfg_path, e))?;
        let config = ModelConfig::from_json_str(&cfg_text, &cfg_path)?;
        Ok(id_of(&config, &cfg_text))
    }

    /// Opens `dir`: reads config.json, maps the safetensors files, indexes tensor names.
    pub fn open(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let cfg_text =
            read_bounded_text(&cfg_path, CONFIG_LIMIT).map_err(|e| Error::io(&cfg_path, e))?;
        let mut config = ModelConfig::from_json_str(&cfg_text, &cfg_path)?;
        // generation_config.json's end-of-sequence ids count too (some models list more there)
        let generation = crate::config::Generation::read(dir)?;
        for t in &generation.eos_token_ids {
            if *t as usize >= config.vocab_size {
                return Err(Error::Config {
                    field: "eos_token_id",
                    value: t.to_string(),
                    reason: format!(
                        "in {}: not a token of the vocabulary (vocab_size {})",
                        dir.join("generation_config.json").display(),
                        config.vocab_size
                    ),
                });
            }
            if !config.eos_token_ids.contains(t) {
                config.eos_token_ids.push(*t);
            }
        }
        let id = id_of(&config, &cfg_text);

        let index_path = dir.join("model.safetensors.index.json");
        let mut shard_names: Vec<String> = Vec::new();
        let mut declared: Option<BTreeMap<String, String>> = None;
        if index_path.exists() {
            let text = read_bounded_text(&index_path, VOCAB_LIMIT)
                .map_err(|e| Error::io(&index_path, e))?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Json {
                path: index_path.clone(),
                reason: e.to_string(),
            })?;
            let wm = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::Json {
                    path: index_path.clone(),
                    reason: "no `weight_map` object".into(),
                })?;
            let mut map = BTreeMap::new();
            for (k, f) in wm {
                let f = f.as_str().ok_or_else(|| Error::Json {
                    path: index_path.clone(),
                    reason: format!("weight_map[{k}] is not a file name"),
                })?;
                if f.contains('/') || f.contains('\\') || f.starts_with('.') {
                    return Err(Error::Json {
                        path: index_path.clone(),
                        reason: format!("weight_map[{k}] = {f:?} is not a plain file name"),
                    });
                }
                if !shard_names.iter().any(|s| s == f) {
                    shard_names.push(f.to_string());
                }
                map.insert(k.clone(), f.to_string());
            }
            declared = Some(map);
        } else {
            let rd = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
            for ent in rd {
                let ent = ent.map_err(|e| Error::io(dir, e))?;
                let name = ent.file_name().to_string_lossy().to_string();
                if name.ends_with(".safetensors") {
                    shard_names.push(name);
                }
            }
            shard_names.sort();
        }
        if shard_names.is_empty() {
            return Err(Error::MissingTensor {
                tensor: "*".into(),
                looked_in: format!("{} (no *.safetensors files)", dir.display()),
            });
        }
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for (i, name) in shard_names.iter().enumerate() {
            let shard = open_shard(&dir.join(name))?;
            for t in shard.meta.tensors().keys() {
                match index.entry(t.clone()) {
                    std::collections::hash_map::Entry::Vacant(e) => {
                        e.insert(i);
                    }
                    // two files hold it: the one the index names, else refused (the last file
                    // read would win silently)
                    std::collections::hash_map::Entry::Occupied(mut e) => match &declared {
                        Some(d) => match d.get(t) {
                            Some(f) if f == name => {
                                e.insert(i);
                            }
                            Some(_) => {}
                            // two files hold a tensor the index does not list
                            None => {
                                return Err(Error::BadSafetensors {
                                    file: dir.join(name),
                                    reason: format!(
                                        "tensor {t:?} is also in {}, and \
                                         model.safetensors.index.json does not say which to \
                                         read",
                                        shard_names[*e.get()]
                                    ),
                                })
                            }
                        },
                        None => {
                            return Err(Error::BadSafetensors {
                                file: dir.join(name),
                                reason: format!(
                                    "tensor {t:?} is also in {}: two files hold it, and no \
                                     model.safetensors.index.json says which to read",
                                    shard_names[*e.get()]
                                ),
                            })
                        }
                    },
                }
            }
            files.push(shard);
        }
        if let Some(declared) = declared {
            for (t, f) in &declared {
                match index.get(t) {
                    Some(&i) if shard_names[i] == *f => {}
                    _ => {
                        return Err(Error::MissingTensor {
                            tensor: t.clone(),
                            looked_in: format!("{} (as the index says)", dir.join(f).display()),
                        })
                    }
                }
            }
        }
        // AutoFP8's checkpoints (`quant_method: "fp8"` with no block size, as neuralmagic's
        // FP8 Mixtral ships): one `weight_scale` per tensor beside each FP8 weight, where
        // DeepSeek's and Qwen's have `weight_scale_inv` per block. Told by the tensors.
        if config.fp8_scales == Fp8Scales::BlockInv
            && config.fp8_block.is_some()
            && !index.keys().any(|n| n.ends_with(".weight_scale_inv"))
            && index.keys().any(|n| n.ends_with(".weight_scale"))
        {
            config.fp8_scales = Fp8Scales::Tensor;
            config.fp8_block = Some(crate::config::FP8_ROW_BLOCK);
        }
        Ok(Checkpoint {
            dir: dir.into(),
            config,
            id,
            files,
            index,
        })
    }

    /// Every tensor name, sorted.
    pub fn tensor_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.index.keys().cloned().collect();
        v.sort();
        v
    }

    pub fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn looked_in(&self) -> String {
        self.files
            .iter()
            .map(|f| f.path.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The raw bytes of a tensor (dtype checked to be FP8, bf16, f16 or f32).
    pub fn raw(&self, name: &str) -> Result<RawTensor<'_>> {
        self.raw_sized(name, dtype_size)
    }

    /// The raw bytes of a tensor of bytes (MXFP4 blocks and exponents: U8).
    fn raw_u8(&self, name: &str) -> Result<RawTensor<'_>> {
        self.raw_sized(name, |d| (d == Dtype::U8).then_some(1))
    }

    fn raw_sized(
        &self,
        name: &str,
        size_of: impl Fn(Dtype) -> Option<usize>,
    ) -> Result<RawTensor<'_>> {
        let &fi = self.index.get(name).ok_or_else(|| Error::MissingTensor {
            tensor: name.into(),
            looked_in: self.looked_in(),
        })?;
        let f = &self.files[fi];
        let info = f.meta.info(name).ok_or_else(|| Error::MissingTensor {
            tensor: name.into(),
            looked_in: f.path.display().to_string(),
        })?;
        let size = size_of(info.dtype).ok_or_else(|| Error::WrongDtype {
            file: f.path.clone(),
            tensor: name.into(),
            found: format!("{:?}", info.dtype),
        })?;
        let (s, e) = info.data_offsets;
        let base = 8 + f.header_len;
        let numel: usize = info.shape.iter().product();
        if e < s || base + e > f.map.len() || e - s != numel * size {
            return Err(Error::BadSafetensors {
                file: f.path.clone(),
                reason: format!(
                    "tensor `{name}`: data offsets {s}..{e} do not fit its shape or the file"
                ),
            });
        }
        Ok(RawTensor {
            file: &f.path,
            dtype: info.dtype,
            shape: &info.shape,
            bytes: &f.map[base + s..base + e],
        })
    }

    /// Reads a tensor as f32, checking its shape.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let raw = self.raw(name)?;
        if raw.shape != shape {
            return Err(Error::WrongShape {
                file: raw.file.into(),
                tensor: name.into(),
                found: raw.shape.to_vec(),
                expected: shape.to_vec(),
            });
        }
        let cols = shape.last().copied().unwrap_or(1);
        let rows = shape.iter().product::<usize>() / cols.max(1);
        Ok(self.stored(name, &raw, rows, cols)?.into_f32())
    }

    /// Reads a 2-D tensor, shape checked, its elements kept in their stored dtype.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let raw = self.raw(name)?;
        self.check_shape(&raw, name, &[rows, cols])?;
        Ok(Matrix::of(rows, cols, self.stored(name, &raw, rows, cols)?))
    }

    /// The elements of `raw` (tensor `name`, `rows x cols`) in their stored dtype; FP8 ones
    /// with their block scales ([`Checkpoint::fp8_scales`]).
    fn stored(&self, name: &str, raw: &RawTensor<'_>, rows: usize, cols: usize) -> Result<Elems> {
        if raw.dtype != Dtype::F8_E4M3 {
            return Ok(elems(raw.dtype, raw.bytes));
        }
        let (block, scale) = self.fp8_scales(name, raw.file, rows, cols)?;
        Ok(Elems::F8(BlockScaled {
            v: raw.bytes.iter().map(|&b| F8(b)).collect(),
            scales: self.held_scales(scale, block, rows, cols),
            cols,
            block,
        }))
    }

    /// The block size and the raw scales of FP8 tensor `name` (`rows x cols`) beside it in
    /// the checkpoint, f32, bf16 or f16, in the shape the config's scheme stores them
    /// ([`Fp8Scales::stored_shape`]): `weight_scale_inv` per block, or compressed-tensors'
    /// `weight_scale` per row, per tensor or per block.
    fn fp8_scales(
        &self,
        name: &str,
        file: &Path,
        rows: usize,
        cols: usize,
    ) -> Result<([usize; 2], RawScales<'_>)> {
        let block = self.config.fp8_block.ok_or_else(|| Error::WrongDtype {
            file: file.into(),
            tensor: name.into(),
            found: "F8_E4M3 (config.json has no fp8 quantization_config)".into(),
        })?;
        let scheme = self.config.fp8_scales;
        let sname = scheme.tensor_of(name);
        let s = self.raw(&sname).map_err(|_| Error::MissingTensor {
            tensor: sname.clone(),
            looked_in: format!("{} (the scales of FP8 tensor `{name}`)", self.looked_in()),
        })?;
        let want = scheme.stored_shape(block, rows, cols);
        // one scale per row may also be stored as `[rows]`, a tensor's one as `[]` or `[1, 1]`
        let same = match scheme {
            Fp8Scales::Channel => s.shape == [rows] || s.shape == want.as_slice(),
            Fp8Scales::Tensor => s.shape.iter().all(|&d| d == 1),
            _ => s.shape == want.as_slice(),
        };
        if !same {
            self.check_shape(&s, &sname, &want)?;
        }
        if !matches!(s.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            return Err(Error::WrongDtype {
                file: s.file.into(),
                tensor: sname,
                found: format!("{:?} (scales are F32, BF16 or F16)", s.dtype),
            });
        }
        Ok((block, (s.dtype, s.bytes)))
    }

    /// The f32 scales a `rows x cols` FP8 matrix is held with, one per block of `block`:
    /// as stored for the block schemes; a row's (or the tensor's) scale repeated over each
    /// of its blocks for compressed-tensors' channel and tensor schemes (the block 1 x 128,
    /// the same products as one scale for the whole row, summed a block at a time).
    fn held_scales(
        &self,
        (dtype, bytes): RawScales<'_>,
        block: [usize; 2],
        rows: usize,
        cols: usize,
    ) -> Vec<f32> {
        let stored = elems(dtype, bytes).into_f32();
        let per_row = cols.div_ceil(block[1].max(1));
        match self.config.fp8_scales {
            Fp8Scales::BlockInv | Fp8Scales::Block => stored,
            Fp8Scales::Channel => stored
                .iter()
                .take(rows)
                .flat_map(|&s| std::iter::repeat_n(s, per_row))
                .collect(),
            Fp8Scales::Tensor => vec![stored.first().copied().unwrap_or(1.0); rows * per_row],
        }
    }

    /// Where decoder layer `layer` keeps its sparse block: `model.layers.L.mlp` (qwen3_moe,
    /// and transformers 5's mixtral) or `model.layers.L.block_sparse_moe` (mixtral as
    /// released).
    pub fn moe_prefix(&self, layer: usize) -> String {
        let mixtral = format!("model.layers.{layer}.block_sparse_moe");
        if self.has(&format!("{mixtral}.gate.weight")) {
            mixtral
        } else {
            format!("model.layers.{layer}.mlp")
        }
    }

    /// The router of decoder layer `layer` (`[E, H]`).
    pub fn router_name(&self, layer: usize) -> String {
        if self.config.family == Family::GptOss {
            return format!("model.layers.{layer}.mlp.router.weight");
        }
        format!("{}.gate.weight", self.moe_prefix(layer))
    }

    /// gpt_oss's expert `e` of decoder layer `layer`: the fused tensors of its layer in bf16
    /// (`gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`) or MXFP4 (`gate_up_proj_blocks
    /// [E, 2I, H/32, 16]` with `gate_up_proj_scales [E, 2I, H/32]`, `down_proj_blocks
    /// [E, H, I/32, 16]` with `down_proj_scales [E, H, I/32]`), and the biases
    /// (`gate_up_proj_bias [E, 2I]`, `down_proj_bias [E, H]`).
    fn gpt_oss_expert_bytes(&self, layer: usize, e: usize) -> Result<ExpertBytes<'_>> {
        let c = &self.config;
        let (h, i, ne) = (c.hidden_size, c.moe_intermediate_size, c.num_experts);
        let p = format!("model.layers.{layer}.mlp.experts");
        let slice = |name: &str, shape: &[usize], u8s: bool| -> Result<(Dtype, &[u8])> {
            let t = format!("{p}.{name}");
            let raw = if u8s { self.raw_u8(&t)? } else { self.raw(&t)? };
            self.check_shape(&raw, &t, shape)?;
            expert_share(
                raw,
                &t,
                e,
                ne,
                "F8_E4M3 (gpt_oss experts are bf16 or MXFP4)",
            )
        };
        let bias = Some([
            slice("gate_up_proj_bias", &[ne, 2 * i], false)?,
            slice("down_proj_bias", &[ne, h], false)?,
        ]);
        if self.has(&format!("{p}.gate_up_proj_blocks")) {
            for (what, n) in [("hidden_size", h), ("intermediate_size", i)] {
                if !n.is_multiple_of(32) {
                    return Err(Error::Config {
                        field: what,
                        value: n.to_string(),
                        reason: "MXFP4 experts need a multiple of 32".into(),
                    });
                }
            }
            let gu = slice("gate_up_proj_blocks", &[ne, 2 * i, h / 32, 16], true)?;
            let gs = slice("gate_up_proj_scales", &[ne, 2 * i, h / 32], true)?;
            let d = slice("down_proj_blocks", &[ne, h, i / 32, 16], true)?;
            let ds = slice("down_proj_scales", &[ne, h, i / 32], true)?;
            return Ok(ExpertBytes {
                layout: ExpertLayout::Mxfp4,
                gate_up: [gu, (Dtype::U8, &[])],
                down: d,
                scales: [Some(gs), None, Some(ds)],
                scales_held: None,
                bias,
            });
        }
        let gu = slice("gate_up_proj", &[ne, h, 2 * i], false)?;
        let d = slice("down_proj", &[ne, i, h], false)?;
        Ok(ExpertBytes {
            layout: ExpertLayout::Columns,
            gate_up: [gu, (gu.0, &[])],
            down: d,
            scales: [None, None, None],
            scales_held: None,
            bias,
        })
    }

    /// gpt_oss's expert from its bytes: gate_up as the gate rows then the up rows (`[2I, H]`),
    /// down `[H, I]`, the biases likewise, in bf16 (MXFP4 widened exactly) or as stored.
    fn gpt_oss_expert(&self, b: &ExpertBytes<'_>) -> Result<ExpertWeights> {
        let c = &self.config;
        let (h, i) = (c.hidden_size, c.moe_intermediate_size);
        let (gate_up, down) = match b.layout {
            ExpertLayout::Mxfp4 => {
                let (Some(gs), Some(ds)) = (b.scales[0], b.scales[2]) else {
                    return Err(Error::Internal("MXFP4 expert without its scales".into()));
                };
                let gu = Elems::Bf16(mxfp4_to_bf16(b.gate_up[0].1, gs.1));
                let d = Elems::Bf16(mxfp4_to_bf16(b.down.1, ds.1));
                (
                    Matrix::of(2 * i, h, gu).deinterleaved(),
                    Matrix::of(h, i, d),
                )
            }
            _ => (
                Matrix::of(h, 2 * i, elems(b.gate_up[0].0, b.gate_up[0].1))
                    .transposed()
                    .deinterleaved(),
                Matrix::of(i, h, elems(b.down.0, b.down.1)).transposed(),
            ),
        };
        let [gb, db] = b
            .bias
            .ok_or_else(|| Error::Internal("gpt_oss expert without its biases".into()))?;
        let gb = elems(gb.0, gb.1).into_f32();
        let gate_up_bias = gb.iter().step_by(2).chain(gb.iter().skip(1).step_by(2));
        Ok(ExpertWeights {
            gate_up,
            down,
            gate_up_bias: gate_up_bias.copied().collect(),
            down_bias: elems(db.0, db.1).into_f32(),
            glu: c.expert_glu,
            checksum: b.checksum(),
        })
    }

    /// The stored bytes of expert `e` of decoder layer `layer`, shapes checked, from any of
    /// the layouts checkpoints use: one tensor per projection and expert (qwen3_moe's
    /// `gate_proj`/`up_proj`/`down_proj`, mixtral's `w1`/`w3`/`w2`), or the experts fused
    /// (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`). `gate_up` is the gate rows then the
    /// up rows (`[2I, H]`), `down` `[H, I]`.
    pub fn expert_bytes(&self, layer: usize, e: usize) -> Result<ExpertBytes<'_>> {
        let c = &self.config;
        if c.family == Family::GptOss {
            return self.gpt_oss_expert_bytes(layer, e);
        }
        let (h, i) = (c.hidden_size, c.moe_intermediate_size);
        let p = format!("{}.experts", self.moe_prefix(layer));
        let per_expert = [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")]
            .into_iter()
            .find(|(g, _, _)| self.has(&format!("{p}.{e}.{g}.weight")));
        if per_expert.is_some() || !self.has(&format!("{p}.gate_up_proj")) {
            let (g, u, d) = per_expert.unwrap_or(("gate_proj", "up_proj", "down_proj"));
            type Part<'a> = ((Dtype, &'a [u8]), Option<(Dtype, &'a [u8])>);
            let part = |name: &str, shape: &[usize]| -> Result<Part<'_>> {
                let t = format!("{p}.{e}.{name}.weight");
                let raw = self.raw(&t)?;
                self.check_shape(&raw, &t, shape)?;
                let scale = if raw.dtype == Dtype::F8_E4M3 {
                    Some(self.fp8_scales(&t, raw.file, shape[0], shape[1])?.1)
                } else {
                    None
                };
                Ok(((raw.dtype, raw.bytes), scale))
            };
            let (gate, gs) = part(g, &[i, h])?;
            let (up, us) = part(u, &[i, h])?;
            let (down, ds) = part(d, &[h, i])?;
            let block = c.fp8_block.unwrap_or([128, 128]);
            let scales_held =
                matches!(c.fp8_scales, Fp8Scales::Channel | Fp8Scales::Tensor).then(|| {
                    let n = |sc: &Option<RawScales<'_>>, r: usize, cols: usize| {
                        sc.map_or(0, |_| crate::config::held_scale_count(block, r, cols))
                    };
                    n(&gs, i, h) + n(&us, i, h) + n(&ds, h, i)
                });
            Ok(ExpertBytes {
                layout: ExpertLayout::Rows,
                bias: None,
                gate_up: [gate, up],
                down,
                scales: [gs, us, ds],
                scales_held,
            })
        } else {
            let ne = c.num_experts;
            let slice = |name: &str, shape: &[usize]| -> Result<(Dtype, &[u8])> {
                let t = format!("{p}.{name}");
                let raw = self.raw(&t)?;
                self.check_shape(&raw, &t, shape)?;
                expert_share(
                    raw,
                    &t,
                    e,
                    ne,
                    "F8_E4M3 in the fused expert layout (FP8 experts are read per expert, as \
                     released)",
                )
            };
            let (dt, gu) = slice("gate_up_proj", &[ne, 2 * i, h])?;
            let down = slice("down_proj", &[ne, h, i])?;
            let half = gu.len() / 2;
            Ok(ExpertBytes {
                layout: ExpertLayout::Rows,
                bias: None,
                gate_up: [(dt, &gu[..half]), (dt, &gu[half..])],
                down,
                scales: [None, None, None],
                scales_held: None,
            })
        }
    }

    /// The stored bytes of one expert (the first of the first MoE layer; a checkpoint keeps
    /// every expert in one dtype).
    pub fn expert_stored_bytes(&self) -> Result<usize> {
        let l = self.config.moe_layers().first().copied().unwrap_or(0);
        Ok(self.expert_bytes(l, 0)?.stored())
    }

    /// The checksum of expert `e` of decoder layer `layer` ([`ExpertBytes::checksum`]): reads
    /// the stored bytes once, converts nothing.
    pub fn expert_checksum(&self, layer: usize, e: usize) -> Result<u64> {
        Ok(self.expert_bytes(layer, e)?.checksum())
    }

    /// Loads expert `e` of decoder layer `layer`, from either tensor layout, in its stored
    /// dtype; its checksum is [`Checkpoint::expert_checksum`]'s, over the bytes as stored.
    pub fn expert(&self, layer: usize, e: usize) -> Result<ExpertWeights> {
        let c = &self.config;
        let (h, i) = (c.hidden_size, c.moe_intermediate_size);
        let b = self.expert_bytes(layer, e)?;
        if b.layout != ExpertLayout::Rows {
            return self.gpt_oss_expert(&b);
        }
        let block = self.config.fp8_block.unwrap_or([128, 128]);
        let part = |(d, bytes): (Dtype, &[u8]), scale: Option<RawScales<'_>>, r, c| match scale {
            Some(sc) => Matrix::of(
                r,
                c,
                Elems::F8(BlockScaled {
                    v: bytes.iter().map(|&x| F8(x)).collect(),
                    scales: self.held_scales(sc, block, r, c),
                    cols: c,
                    block,
                }),
            ),
            None => Matrix::of(r, c, elems(d, bytes)),
        };
        let [g, u] = b.gate_up;
        Ok(ExpertWeights::new(
            Matrix::stack(&[part(g, b.scales[0], i, h), part(u, b.scales[1], i, h)]),
            part(b.down, b.scales[2], h, i),
            b.checksum(),
        ))
    }

    fn check_shape(&self, raw: &RawTensor<'_>, name: &str, shape: &[usize]) -> Result<()> {
        if raw.shape != shape {
            return Err(Error::WrongShape {
                file: raw.file.into(),
                tensor: name.into(),
                found: raw.shape.to_vec(),
                expected: shape.to_vec(),
            });
        }
        Ok(())
    }

    /// Bytes of every tensor's data as stored (the shards less their headers).
    pub fn tensor_bytes(&self) -> usize {
        self.index
            .keys()
            .filter_map(|n| self.raw(n).or_else(|_| self.raw_u8(n)).ok())
            .map(|r| r.bytes.len())
            .sum()
    }

    /// Total bytes of all mapped shards.
    pub fn total_bytes(&self) -> usize {
        self.files.iter().map(|f| f.map.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::Elem;

    #[test]
    fn mxfp4_widens_exactly() {
        // low nibble first; codes 1 (0.5) and 0xa (-1.0); exponents 2^1 and 2^-3
        let mut blocks = vec![0u8; 32];
        blocks[0] = 0xa1;
        blocks[16] = 0x7f; // -6.0 then 6.0
        let v = mxfp4_to_bf16(&blocks, &[128, 124]);
        let f = |i: usize| Elem::f32(v[i]);
        assert_eq!(v.len(), 64);
        assert_eq!((f(0), f(1), f(2)), (1.0, -2.0, 0.0));
        assert_eq!((f(32), f(33)), (-0.75, 0.75));
    }
}
