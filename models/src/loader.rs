//! Loading a model from a `.gguf` file or an HF directory (`config.json` + safetensors).
//!
//! GGUF tensors are read one by one (quantized blocks stay quantized in `Native` mode);
//! safetensors are memory-mapped by candle. Every malformed input ends in an
//! [`Error::Io`] / [`Error::InvalidModel`] / [`Error::Missing`] naming the file.
//!
//! Architectures build themselves from any [`WeightSource`]: the checkpoint [`Weights`], or
//! the random weights of [`crate::random`] (benchmarks of real shapes without the files).

use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};

use crate::arch::{self, Checkpoint};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::layers::{Embedding, Linear};
use crate::model::Model;
use crate::weights::{Bias, WeightDType, Weights};

/// Where an architecture's tensors come from, by HF name.
pub trait WeightSource {
    /// The device tensors are created on.
    fn device(&self) -> &Device;

    /// A 1-D tensor of `len` elements (a norm weight) as dense f32.
    ///
    /// # Errors
    /// [`Error::Missing`] if absent, [`Error::InvalidModel`] if unreadable or of another shape.
    fn vector(&mut self, hf: &str, len: usize) -> Result<Tensor>;

    /// The projection `{prefix}.weight` `[out, in]` (+ `{prefix}.bias` as `bias` says).
    ///
    /// # Errors
    /// [`Error::Missing`] for an absent required tensor, [`Error::InvalidModel`] for a wrong
    /// shape.
    fn linear(&mut self, prefix: &str, dims: (usize, usize), bias: Bias) -> Result<Linear>;

    /// The token embedding `[vocab, hidden]` and the lm_head (sharing its storage when `tied`).
    ///
    /// # Errors
    /// As [`WeightSource::linear`].
    fn embedding_and_head(
        &mut self,
        dims: (usize, usize),
        tied: bool,
    ) -> Result<(Embedding, Linear)>;
}

impl WeightSource for Weights {
    fn device(&self) -> &Device {
        Weights::device(self)
    }

    fn vector(&mut self, hf: &str, len: usize) -> Result<Tensor> {
        let t = Weights::vector(self, hf)?;
        match t.dims1()? == len {
            true => Ok(t),
            false => Err(invalid(
                self.path(),
                format!("{hf} has {} elements, expected {len}", t.dims1()?),
            )),
        }
    }

    fn linear(&mut self, prefix: &str, dims: (usize, usize), bias: Bias) -> Result<Linear> {
        Weights::linear(self, prefix, dims, bias)
    }

    fn embedding_and_head(
        &mut self,
        dims: (usize, usize),
        tied: bool,
    ) -> Result<(Embedding, Linear)> {
        Weights::embedding_and_head(self, dims, tied)
    }
}

/// How to load a model.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// The dtype weights are kept in.
    pub dtype: WeightDType,
    /// Where tensors live.
    pub device: Device,
    /// Tokens per chunk in [`Model::prefill`].
    pub prefill_chunk: usize,
}

impl Default for LoadOptions {
    /// Native dtype, CPU, chunks of 512.
    fn default() -> Self {
        Self {
            dtype: WeightDType::Native,
            device: Device::Cpu,
            prefill_chunk: 512,
        }
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn invalid(path: &Path, reason: impl Into<String>) -> Error {
    Error::InvalidModel {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Whether `path` names a GGUF file (by extension) rather than an HF directory.
fn is_gguf(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// Reads and checks a GGUF header: every tensor must lie inside the file.
///
/// # Errors
/// [`Error::Io`] if unreadable, [`Error::UnsupportedQuant`] for a tensor type candle lacks,
/// [`Error::InvalidModel`] for a corrupt header or a truncated file.
pub fn read_gguf(path: &Path) -> Result<(gguf_file::Content, File)> {
    let mut file = File::open(path).map_err(io(path))?;
    let file_len = file.metadata().map_err(io(path))?.len();
    let content = gguf_file::Content::read(&mut file).map_err(|e| {
        let msg = e.to_string();
        match msg.strip_prefix("unknown dtype for tensor ") {
            Some(code) => Error::UnsupportedQuant {
                tensor: "(a tensor in the GGUF header)".into(),
                dtype: format!("GGML type id {code}"),
            },
            None => invalid(path, format!("not a readable GGUF file: {msg}")),
        }
    })?;
    for (name, info) in &content.tensor_infos {
        let elems = info.shape.elem_count() as u64;
        let block = info.ggml_dtype.block_size() as u64;
        let bytes = elems / block * info.ggml_dtype.type_size() as u64;
        let end = content.tensor_data_offset + info.offset + bytes;
        if end > file_len {
            return Err(invalid(
                path,
                format!("truncated: tensor {name} ends at byte {end}, the file has {file_len}"),
            ));
        }
    }
    Ok((content, file))
}

/// The safetensors files of an HF directory: the shards listed in
/// `model.safetensors.index.json`, or `model.safetensors`.
pub(crate) fn safetensors_shards(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(io(&index))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| invalid(&index, format!("not JSON: {e}")))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| invalid(&index, "no weight_map object"))?;
        let mut files: Vec<PathBuf> = Vec::new();
        for f in map.values() {
            let f = f
                .as_str()
                .ok_or_else(|| invalid(&index, "weight_map value is not a string"))?;
            let p = dir.join(f);
            if !files.contains(&p) {
                files.push(p);
            }
        }
        return Ok(files);
    }
    let single = dir.join("model.safetensors");
    match single.exists() {
        true => Ok(vec![single]),
        false => Err(Error::Missing {
            what: "model.safetensors or model.safetensors.index.json".into(),
            path: dir.to_path_buf(),
        }),
    }
}

/// Loads only the weights of a model (no tokenizer), from a `.gguf` file or an HF directory.
///
/// # Errors
/// [`Error::Io`], [`Error::InvalidModel`], [`Error::Missing`] for bad files,
/// [`Error::UnsupportedArchitecture`] / [`Error::UnsupportedQuant`] for what is not
/// implemented, [`Error::InvalidRequest`] for `prefill_chunk == 0`.
pub fn load_model(path: &Path, opts: &LoadOptions) -> Result<Model> {
    match is_gguf(path) {
        true => {
            let (content, file) = read_gguf(path)?;
            load_gguf_model(path, content, file, opts)
        }
        false => load_hf_model(path, opts),
    }
}

/// Builds the model from an already-read GGUF header.
fn load_gguf_model(
    path: &Path,
    content: gguf_file::Content,
    file: File,
    opts: &LoadOptions,
) -> Result<Model> {
    let config = ModelConfig::from_gguf(&content, path)?;
    let name = arch::canonical(&config.model_type)?;
    tracing::info!(path = %path.display(), arch = name, dtype = ?opts.dtype, "loading GGUF");
    let mut weights = Weights::gguf(content, file, path, opts.dtype, &opts.device);
    let net = arch::load(&config, &mut weights, Checkpoint::Gguf)?;
    Model::from_parts(net, config, path, opts.prefill_chunk, &opts.device)
}

fn load_hf_model(dir: &Path, opts: &LoadOptions) -> Result<Model> {
    if !dir.is_dir() {
        let reason = match dir.exists() {
            true => "neither a .gguf file nor an HF model directory",
            false => "no such file or directory",
        };
        return Err(Error::Io {
            path: dir.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, reason),
        });
    }
    let config = ModelConfig::from_hf_json(&dir.join("config.json"))?;
    let name = arch::canonical(&config.model_type)?;
    tracing::info!(path = %dir.display(), arch = name, dtype = ?opts.dtype, "loading safetensors");
    let shards = safetensors_shards(dir)?;
    let mut weights = Weights::safetensors(dir, &shards, opts.dtype, &opts.device)?;
    // HF checkpoints keep q/k rows in the half-split layout.
    let net = arch::load(&config, &mut weights, Checkpoint::Hf)?;
    Model::from_parts(net, config, dir, opts.prefill_chunk, &opts.device)
}

/// A model with everything needed to talk to it in text.
#[derive(Clone)]
pub struct LoadedModel {
    /// The network.
    pub model: Model,
    /// Its tokenizer (from GGUF metadata or `tokenizer.json`).
    pub tokenizer: crate::tokenizer::Tokenizer,
    /// Its chat template, when the model ships one.
    pub chat_template: Option<crate::chat::ChatTemplate>,
}

/// Loads a model with its tokenizer and chat template, from a `.gguf` file or an HF directory.
///
/// # Errors
/// As [`load_model`], plus [`Error::Tokenizer`] / [`Error::ChatTemplate`] for a tokenizer or
/// template that cannot be rebuilt.
pub fn load(path: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    let (model, tokenizer, chat_template) = if is_gguf(path) {
        let (content, file) = read_gguf(path)?;
        // The header is parsed once: tokenizer and template come from the same metadata.
        let tokenizer = crate::tokenizer::Tokenizer::from_gguf(&content)?;
        let chat_template = crate::chat::ChatTemplate::from_gguf(&content, &tokenizer)?;
        (
            load_gguf_model(path, content, file, opts)?,
            tokenizer,
            chat_template,
        )
    } else {
        let model = load_hf_model(path, opts)?;
        let tokenizer = crate::tokenizer::Tokenizer::from_hf_dir(path)?;
        let chat_template = crate::chat::ChatTemplate::from_hf_dir(path, &tokenizer)?;
        (model, tokenizer, chat_template)
    };
    Ok(LoadedModel {
        model,
        tokenizer,
        chat_template,
    })
}
