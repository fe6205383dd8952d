//! The prompt tokenizer: Qwen's byte-level BPE (`tokenizer/tokenizer.json`) plus the chat template and the
//! padding the Z-Image pipelines apply before the text encoder.
//!
//! diffusers' `ZImagePipeline._encode_prompt` does, per prompt:
//! `apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, enable_thinking=True)`,
//! then tokenizes with `padding="max_length", max_length=max_sequence_length, truncation=True` (right side, pad
//! token `<|endoftext|>`). [`PromptTokenizer::encode`] reproduces that; the mask marks the real tokens.
//!
//! The template is the checkpoint's own when it carries one ([`ChatTemplate::from_dir`]: `chat_template.jinja`,
//! or `chat_template` in `tokenizer_config.json`, as transformers reads them), rendered with minijinja as
//! transformers renders it (`trim_blocks`, `lstrip_blocks`, Python's string methods); without one, the standard
//! Qwen3 template, whose output for a single user turn is [`apply_chat_template`]'s string.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::{Bool, Device, Int, Tensor, TensorData};

use crate::{Error, Result};

/// The pad token of Qwen tokenizers, used when `tokenizer_config.json` names none.
pub const DEFAULT_PAD_TOKEN: &str = "<|endoftext|>";

/// The sequence length Z-Image-Turbo encodes prompts to (`max_sequence_length` of the pipeline).
pub const Z_IMAGE_MAX_SEQUENCE_LENGTH: usize = 512;

/// Wraps a user prompt in the Qwen3 chat template with the assistant turn opened, as the Z-Image pipeline does.
pub fn apply_chat_template(prompt: &str) -> String {
    format!("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
}

/// The chat template a prompt is wrapped in before it is tokenized.
#[derive(Clone)]
pub enum ChatTemplate {
    /// The checkpoint's own Jinja template, compiled.
    Checkpoint {
        /// Where it was read from, for messages.
        source: PathBuf,
        /// The environment holding the compiled template `chat`.
        env: Arc<minijinja::Environment<'static>>,
    },
    /// The standard Qwen3 template's output for one user turn ([`apply_chat_template`]).
    Qwen3,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChatTemplate::Checkpoint { source, .. } => write!(f, "ChatTemplate::Checkpoint({})", source.display()),
            ChatTemplate::Qwen3 => f.write_str("ChatTemplate::Qwen3"),
        }
    }
}

impl ChatTemplate {
    /// The template of a tokenizer directory, as transformers finds it: `chat_template.jinja`, else a string
    /// `chat_template` in `tokenizer_config.json` (or the entry named `default` of a list of named templates),
    /// else [`ChatTemplate::Qwen3`]. A template that does not compile, or does not render a probe prompt, is an
    /// error naming its file.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let jinja = dir.join("chat_template.jinja");
        let config = dir.join("tokenizer_config.json");
        let (source, text) = if jinja.is_file() {
            (jinja.clone(), crate::config::read_text(&jinja)?)
        } else if let Some(text) = template_in_config(&config)? {
            (config, text)
        } else {
            return Ok(ChatTemplate::Qwen3);
        };
        Self::compile(source, text)
    }

    /// Compiles `text` (read from `source`) and checks that it renders a probe prompt.
    pub fn compile(source: PathBuf, text: String) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| template_error(&source, &e))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_template_owned("chat", text).map_err(|e| template_error(&source, &e))?;
        let template = ChatTemplate::Checkpoint { source, env: Arc::new(env) };
        template.apply("a probe")?;
        Ok(template)
    }

    /// Wraps `prompt` as the Z-Image pipeline does: one user turn, the assistant turn opened, thinking enabled.
    pub fn apply(&self, prompt: &str) -> Result<String> {
        match self {
            ChatTemplate::Qwen3 => Ok(apply_chat_template(prompt)),
            ChatTemplate::Checkpoint { source, env } => {
                let template = env.get_template("chat").map_err(|e| template_error(source, &e))?;
                let context = minijinja::context! {
                    messages => vec![minijinja::context! { role => "user", content => prompt }],
                    add_generation_prompt => true,
                    enable_thinking => true,
                };
                template.render(context).map_err(|e| template_error(source, &e))
            }
        }
    }
}

fn template_error(source: &Path, error: &minijinja::Error) -> Error {
    Error::Tokenizer(format!(
        "cannot render the chat template of {}: {error:#}; fix the template, or remove it to use the standard \
         Qwen3 template",
        source.display()
    ))
}

/// `chat_template` of a `tokenizer_config.json`: a string, or the `default` entry of a list of named templates.
fn template_in_config(path: &Path) -> Result<Option<String>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = crate::config::read_text(path)?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|source| Error::Json { path: path.to_path_buf(), source })?;
    Ok(match value.get("chat_template") {
        Some(serde_json::Value::String(template)) => Some(template.clone()),
        Some(serde_json::Value::Array(named)) => named
            .iter()
            .find(|entry| entry.get("name").and_then(serde_json::Value::as_str) == Some("default"))
            .and_then(|entry| entry.get("template").and_then(serde_json::Value::as_str))
            .map(str::to_owned),
        _ => None,
    })
}

/// A batch of tokenized prompts, each padded (right) or truncated to the same length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizedPrompts {
    /// Token ids, `[batch][max_sequence_length]`, pad id after the real tokens.
    pub input_ids: Vec<Vec<u32>>,
    /// `true` for real tokens, `false` for padding, same shape as `input_ids`.
    pub attention_mask: Vec<Vec<bool>>,
}

impl TokenizedPrompts {
    /// The number of prompts.
    pub fn batch_size(&self) -> usize {
        self.input_ids.len()
    }

    /// The padded length of every prompt.
    pub fn seq_len(&self) -> usize {
        self.input_ids.first().map_or(0, Vec::len)
    }

    /// The number of real (unpadded) tokens of each prompt.
    pub fn lengths(&self) -> Vec<usize> {
        self.attention_mask.iter().map(|m| m.iter().filter(|&&on| on).count()).collect()
    }

    /// The ids as an int tensor `[batch, seq_len]` on `device`.
    pub fn input_ids_tensor(&self, device: &Device) -> Tensor<2, Int> {
        let flat: Vec<i64> = self.input_ids.iter().flatten().map(|&id| i64::from(id)).collect();
        Tensor::from_data(TensorData::new(flat, [self.batch_size(), self.seq_len()]), device)
    }

    /// The mask as a bool tensor `[batch, seq_len]` on `device` (`true` = real token).
    pub fn attention_mask_tensor(&self, device: &Device) -> Tensor<2, Bool> {
        let flat: Vec<bool> = self.attention_mask.iter().flatten().copied().collect();
        Tensor::from_data(TensorData::new(flat, [self.batch_size(), self.seq_len()]), device)
    }
}

/// The Qwen tokenizer with Z-Image's template, padding and truncation.
#[derive(Debug, Clone)]
pub struct PromptTokenizer {
    inner: tokenizers::Tokenizer,
    pad_id: u32,
    max_sequence_length: usize,
    template: ChatTemplate,
}

impl PromptTokenizer {
    /// Loads `dir/tokenizer.json`; the pad token is `pad_token` of `dir/tokenizer_config.json` when that file
    /// names one, else [`DEFAULT_PAD_TOKEN`]; the chat template is the directory's own when it has one
    /// ([`ChatTemplate::from_dir`]).
    ///
    /// Errors if the file is missing or unreadable, the pad token is not in the vocabulary, or
    /// `max_sequence_length` is 0.
    pub fn from_dir(dir: impl AsRef<Path>, max_sequence_length: usize) -> Result<Self> {
        let dir = dir.as_ref();
        let file = dir.join("tokenizer.json");
        if !file.is_file() {
            return Err(Error::MissingFile {
                component: "tokenizer".to_owned(),
                what: "tokenizer.json".to_owned(),
                path: file,
            });
        }
        let pad_token = read_pad_token(&dir.join("tokenizer_config.json"))?;
        let inner = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| Error::Tokenizer(format!("cannot load {}: {e}", file.display())))?;
        Ok(Self::new(inner, &pad_token, max_sequence_length)?.with_template(ChatTemplate::from_dir(dir)?))
    }

    /// The same tokenizer wrapping prompts in `template`.
    pub fn with_template(self, template: ChatTemplate) -> Self {
        Self { template, ..self }
    }

    /// The chat template prompts are wrapped in.
    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    /// Wraps an already loaded tokenizer, with the standard Qwen3 template. Any padding or truncation configured in
    /// it is ignored: this type pads and truncates itself.
    pub fn new(mut inner: tokenizers::Tokenizer, pad_token: &str, max_sequence_length: usize) -> Result<Self> {
        if max_sequence_length == 0 {
            return Err(Error::Tokenizer("max_sequence_length must be at least 1".to_owned()));
        }
        let pad_id = inner
            .token_to_id(pad_token)
            .ok_or_else(|| Error::Tokenizer(format!("pad token {pad_token:?} is not in the vocabulary")))?;
        inner.with_padding(None);
        inner.with_truncation(None).map_err(|e| Error::Tokenizer(format!("cannot disable truncation: {e}")))?;
        Ok(Self { inner, pad_id, max_sequence_length, template: ChatTemplate::Qwen3 })
    }

    /// The id written after the real tokens.
    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// The same tokenizer padding and truncating to `max_sequence_length` tokens.
    pub fn with_max_sequence_length(&self, max_sequence_length: usize) -> Self {
        Self { max_sequence_length, ..self.clone() }
    }

    /// The length every prompt is padded or truncated to.
    pub fn max_sequence_length(&self) -> usize {
        self.max_sequence_length
    }

    /// The vocabulary size including added tokens (what the text encoder's embedding must cover).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Templates, tokenizes, truncates (keeping the first tokens) and right-pads every prompt.
    pub fn encode<S: AsRef<str>>(&self, prompts: &[S]) -> Result<TokenizedPrompts> {
        let mut input_ids = Vec::with_capacity(prompts.len());
        let mut attention_mask = Vec::with_capacity(prompts.len());
        for prompt in prompts {
            let text = self.template.apply(prompt.as_ref())?;
            let encoding = self
                .inner
                .encode(text.as_str(), true)
                .map_err(|e| Error::Tokenizer(format!("cannot encode prompt {:?}: {e}", prompt.as_ref())))?;
            let mut ids = encoding.get_ids().to_vec();
            ids.truncate(self.max_sequence_length);
            let real = ids.len();
            ids.resize(self.max_sequence_length, self.pad_id);
            let mut mask = vec![true; real];
            mask.resize(self.max_sequence_length, false);
            input_ids.push(ids);
            attention_mask.push(mask);
        }
        Ok(TokenizedPrompts { input_ids, attention_mask })
    }
}

/// Reads `pad_token` from `tokenizer_config.json` (a string or an `AddedToken` object with `content`);
/// falls back to [`DEFAULT_PAD_TOKEN`] when the file or the field is absent.
fn read_pad_token(path: &Path) -> Result<String> {
    if !path.is_file() {
        return Ok(DEFAULT_PAD_TOKEN.to_owned());
    }
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_owned(), source })?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|source| Error::Json { path: path.to_owned(), source })?;
    let token = match value.get("pad_token") {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Object(o)) => o.get("content").and_then(|c| c.as_str()).map(str::to_owned),
        _ => None,
    };
    Ok(token.unwrap_or_else(|| DEFAULT_PAD_TOKEN.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_matches_qwen3_with_generation_prompt() {
        assert_eq!(apply_chat_template("a cat"), "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn missing_directory_is_a_missing_file_error() {
        let err = PromptTokenizer::from_dir("/nonexistent/tokenizer", 8).expect_err("must fail");
        assert!(matches!(err, Error::MissingFile { .. }), "{err}");
    }
}
