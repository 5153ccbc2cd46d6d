//! Real weights for the step: a GGUF checkpoint (any quantization candle reads) dequantized
//! to f32 through specula-models' GGUF reader and rounded to bf16, in the kernels' layout:
//! q|k|v fused (and their biases), gate|up interleaved row by row, q/k rows in the half-split
//! rope layout (llama.cpp's converter permutes llama q/k rows to interleaved pairs; this undoes
//! it, as the CPU runtime's rope does the opposite), the lm_head absent when tied.
//!
//! Only the host side: [`crate::reference::HostWeights::upload`] copies the result to the GPU.

use std::path::Path;

use half::bf16;
use specula_models::config::ModelConfig;
use specula_models::loader::read_gguf;
use specula_models::weights::gguf_name;

use crate::error::{Error, Result};
use crate::reference::{HostLayer, HostWeights};
use crate::shape::Shape;

/// The step's shape of a specula-models config (not yet checked against the kernels'
/// tiling: [`Shape::check`] does that, so that tiny test models still map).
///
/// # Errors
/// [`Error::Unsupported`] for an architecture outside llama, mistral, qwen2, qwen3.
pub fn shape_of(c: &ModelConfig) -> Result<Shape> {
    if !matches!(
        c.model_type.as_str(),
        "llama" | "mistral" | "qwen2" | "qwen3"
    ) {
        return Err(Error::Unsupported(format!(
            "architecture '{}' (the CUDA step runs llama, mistral, qwen2, qwen3)",
            c.model_type
        )));
    }
    Ok(Shape {
        vocab: c.vocab_size,
        hidden: c.hidden_size,
        intermediate: c.intermediate_size,
        layers: c.num_hidden_layers,
        heads: c.num_attention_heads,
        kv_heads: c.kv_heads(),
        head_dim: c.head_dim(),
        rms_eps: c.rms_norm_eps as f32,
        rope_theta: c.rope_theta,
        tied_embeddings: c.tie_word_embeddings,
        qkv_bias: c.attention_bias,
        qk_norm: c.qk_norm,
    })
}

/// Reads the GGUF file at `path`: its config (as the CPU runtime reads it), the step's shape and
/// every weight as bf16 bits in the kernels' layout.
///
/// # Errors
/// [`Error::Invalid`] for a file specula-models cannot read, a missing tensor or one of
/// another size; [`Error::Unsupported`] for another architecture.
pub fn load_gguf(path: &Path) -> Result<(ModelConfig, Shape, HostWeights)> {
    let bad = |e: specula_models::Error| Error::Invalid(format!("{}: {e}", path.display()));
    let (content, mut file) = read_gguf(path).map_err(bad)?;
    let config = ModelConfig::from_gguf(&content, path).map_err(bad)?;
    let shape = shape_of(&config)?;
    // llama.cpp permutes llama (and mistral) q/k rows; qwen files keep the HF layout.
    let permuted = matches!(config.model_type.as_str(), "llama" | "mistral");
    let mut read = |hf: &str, len: usize| -> Result<Vec<f32>> {
        let name = gguf_name(hf).ok_or_else(|| Error::Invalid(format!("no GGUF name for {hf}")))?;
        let q = content
            .tensor(&mut file, &name, &candle_core::Device::Cpu)
            .map_err(|e| Error::Invalid(format!("{}: tensor {name}: {e}", path.display())))?;
        let v = q
            .dequantize(&candle_core::Device::Cpu)
            .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
            .map_err(|e| Error::Invalid(format!("{}: tensor {name}: {e}", path.display())))?;
        if v.len() != len {
            return Err(Error::Invalid(format!(
                "{}: tensor {name} has {} values, the config says {len}",
                path.display(),
                v.len()
            )));
        }
        Ok(v)
    };
    let (h, hd) = (shape.hidden, shape.head_dim);
    let (qw, kvw) = (shape.heads * hd, shape.kv_heads * hd);
    let mut layers = Vec::with_capacity(shape.layers);
    for l in 0..shape.layers {
        let p = format!("model.layers.{l}");
        let mut q = read(&format!("{p}.self_attn.q_proj.weight"), qw * h)?;
        let mut k = read(&format!("{p}.self_attn.k_proj.weight"), kvw * h)?;
        let v = read(&format!("{p}.self_attn.v_proj.weight"), kvw * h)?;
        if permuted {
            q = unpermute_rows(&q, shape.heads, hd, h);
            k = unpermute_rows(&k, shape.kv_heads, hd, h);
        }
        let qkv_bias = if shape.qkv_bias {
            let mut qb = read(&format!("{p}.self_attn.q_proj.bias"), qw)?;
            let mut kb = read(&format!("{p}.self_attn.k_proj.bias"), kvw)?;
            let vb = read(&format!("{p}.self_attn.v_proj.bias"), kvw)?;
            if permuted {
                qb = unpermute_rows(&qb, shape.heads, hd, 1);
                kb = unpermute_rows(&kb, shape.kv_heads, hd, 1);
            }
            Some(bits(&[qb, kb, vb].concat()))
        } else {
            None
        };
        let norm = |r: &mut dyn FnMut(&str, usize) -> Result<Vec<f32>>, n: &str| {
            r(&format!("{p}.self_attn.{n}.weight"), hd).map(|v| bits(&v))
        };
        let (q_norm, k_norm) = if shape.qk_norm {
            (
                Some(norm(&mut read, "q_norm")?),
                Some(norm(&mut read, "k_norm")?),
            )
        } else {
            (None, None)
        };
        let gate = read(&format!("{p}.mlp.gate_proj.weight"), shape.intermediate * h)?;
        let up = read(&format!("{p}.mlp.up_proj.weight"), shape.intermediate * h)?;
        layers.push(HostLayer {
            attn_norm: bits(&read(&format!("{p}.input_layernorm.weight"), h)?),
            qkv: bits(&[q, k, v].concat()),
            qkv_bias,
            q_norm,
            k_norm,
            o: bits(&read(&format!("{p}.self_attn.o_proj.weight"), h * qw)?),
            mlp_norm: bits(&read(&format!("{p}.post_attention_layernorm.weight"), h)?),
            gate_up: bits(&interleave_rows(&gate, &up, h)),
            down: bits(&read(
                &format!("{p}.mlp.down_proj.weight"),
                h * shape.intermediate,
            )?),
        });
    }
    let embed = bits(&read("model.embed_tokens.weight", shape.vocab * h)?);
    let final_norm = bits(&read("model.norm.weight", h)?);
    // A tied model may still ship `output.weight` (some converters do): the step then reads it.
    let lm_head = if content.tensor_infos.contains_key("output.weight") {
        Some(bits(&read("lm_head.weight", shape.vocab * h)?))
    } else if shape.tied_embeddings {
        None
    } else {
        return Err(Error::Invalid(format!(
            "{}: no output.weight in an untied model",
            path.display()
        )));
    };
    let mut shape = shape;
    shape.tied_embeddings = lm_head.is_none();
    let weights = HostWeights {
        embed,
        layers,
        final_norm,
        lm_head,
    };
    Ok((config, shape, weights))
}

fn bits(v: &[f32]) -> Vec<u16> {
    v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect()
}

/// The inverse of llama.cpp's `permute` on the `heads * hd` rows of `cols` values each: row
/// `2j + s` of a head (interleaved pairs) goes back to row `s * hd / 2 + j` (halves).
pub fn unpermute_rows(w: &[f32], heads: usize, hd: usize, cols: usize) -> Vec<f32> {
    let half = hd / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..heads {
        for j in 0..half {
            for s in 0..2 {
                let from = (h * hd + 2 * j + s) * cols;
                let to = (h * hd + s * half + j) * cols;
                out[to..to + cols].copy_from_slice(&w[from..from + cols]);
            }
        }
    }
    out
}

/// Rows of `gate` and `up` (`[n, cols]` each) interleaved: row `2j` gate `j`, `2j + 1` up `j`.
pub fn interleave_rows(gate: &[f32], up: &[f32], cols: usize) -> Vec<f32> {
    gate.chunks(cols)
        .zip(up.chunks(cols))
        .flat_map(|(g, u)| g.iter().chain(u).copied())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{rel_err, Reference};
    use candle_core::quantized::GgmlDType;
    use specula_models::testing::TinyModel;
    use specula_models::{ForwardRequest, LoadOptions, WeightDType};

    #[test]
    fn unpermute_inverts_the_converters_permutation() {
        // One head of width 4 over 1 column: halves (a0 a1 | b0 b1) are stored a0 b0 a1 b1.
        let stored = [10.0, 20.0, 11.0, 21.0, 30.0, 40.0, 31.0, 41.0];
        assert_eq!(
            unpermute_rows(&stored, 2, 4, 1),
            vec![10.0, 11.0, 20.0, 21.0, 30.0, 31.0, 40.0, 41.0]
        );
        assert_eq!(
            interleave_rows(&[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0], 2),
            vec![1.0, 2.0, 5.0, 6.0, 3.0, 4.0, 7.0, 8.0]
        );
    }

    /// The step's reference forward over weights from a GGUF file gives the CPU runtime's
    /// logits for the same file: the loader's layout (fused q|k|v, un-permuted llama rows,
    /// interleaved gate|up, tied head) is the one the kernels read.
    #[test]
    fn gguf_weights_give_the_cpu_runtimes_logits() {
        let dir = std::env::temp_dir().join(format!("specula-cuda-ckpt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for arch in ["llama", "qwen2", "qwen3"] {
            let path = dir.join(format!("{arch}.gguf"));
            TinyModel::new(arch, 11)
                .unwrap()
                .write_gguf(&path, GgmlDType::Q8_0)
                .unwrap();
            let (_, shape, host) = load_gguf(&path).unwrap();
            assert_eq!(shape.qkv_bias, arch == "qwen2");
            assert_eq!(shape.qk_norm, arch == "qwen3");
            let opts = LoadOptions {
                dtype: WeightDType::F32,
                ..LoadOptions::default()
            };
            let model = specula_models::load_model(&path, &opts).unwrap();
            let tokens = [1u32, 5, 17, 33, 80, 2, 64, 9];
            let mut cache = model.new_cache();
            let req = ForwardRequest {
                logits: specula_models::Rows::All,
                ..ForwardRequest::default()
            };
            let cpu = model.forward(&tokens, &mut cache, &req).unwrap().logits;
            let cpu: Vec<f32> = cpu.flatten_all().unwrap().to_vec1().unwrap();
            let mut reference = Reference::new(shape.clone(), host, 16);
            let ours = reference.forward(&tokens, 0);
            // bf16 weights and activations against f32: about 1% of the logits' norm.
            let err = rel_err(&ours, &cpu);
            assert!(err < 0.03, "{arch}: relative error {err}");
            let argmax = |v: &[f32]| {
                v.chunks(shape.vocab)
                    .map(|r| {
                        r.iter()
                            .enumerate()
                            .max_by(|a, b| a.1.total_cmp(b.1))
                            .unwrap()
                            .0
                    })
                    .collect::<Vec<_>>()
            };
            let same = argmax(&ours)
                .iter()
                .zip(argmax(&cpu))
                .filter(|(a, b)| **a == *b)
                .count();
            assert!(same >= tokens.len() - 1, "{arch}: {same} argmax equal");
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
