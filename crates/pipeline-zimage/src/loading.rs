//! Opening a diffusers checkpoint directory and loading (sharded) safetensors into any burn module, loudly.
//!
//! This is the crate's validating edge for checkpoints: [`Checkpoint::open`] checks `model_index.json`, each
//! component's directory and `config.json` are checked when read, and [`load_component`] checks every tensor.
//! The model code behind it trusts what it is given.
//!
//! Loading goes through burn-store's `SafetensorsStore`, one store per shard, with the identity adapter (the
//! modules in [`crate::nn`] keep PyTorch names and layouts), an optional float cast ([`LoadOptions::dtype`]) and
//! optional key renames ([`LoadOptions::key_remap`], e.g. [`crate::transformer::KEY_REMAP`]). The per-shard
//! results are aggregated into one [`LoadReport`]; a load that leaves any parameter missing or any file tensor
//! unused is refused with [`Error::PartialLoad`] unless [`LoadOptions::allow_partial`] is set, and a tensor of
//! the wrong shape or kind is an error naming the tensor and its file.
//!
//! Tensor names in reports and errors are the names after key remapping (identical to the file's names for
//! every tensor except the remapped prefixes).
//!
//! # The file tier
//!
//! [`bind_component`] (and [`Checkpoint::bind_transformer`], [`Checkpoint::bind_text_encoder`],
//! [`Checkpoint::bind_vae`]) is the counterpart of [`load_component`] that reads no weight: it opens the
//! component's shards by their headers (`group_offload::weights::WeightIndex`, with the same key renames), binds a
//! freshly built, lazy model to them (`group_offload::weights::bind`: every parameter the files hold reads its file
//! tensor when touched, and nothing touches it under group offload), checks every shape and dtype, and gives the
//! same [`LoadReport`] with the same refusal rules. The model's host copy is then its checkpoint file: register it
//! with `group_offload::ModelHandle::register_files` and the weights stream from the file (the page cache is their
//! memory), so the process never holds the component in anonymous memory.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::module::Module;
use burn::store::{
    ApplyError, ApplyResult, FloatCastAdapter, IdentityAdapter, KeyRemapper, ModuleSnapshot, SafetensorsStore,
    SafetensorsStoreError,
};
use burn::tensor::{DType, Device};
use serde::Deserialize;
use serde::de::DeserializeOwned;

use burn::tensor::quantization::QuantScheme;
use burn::tensor::{Tensor, TensorData};
use group_offload::weights::{BindOptions, FileTable, TensorPlace, TensorTransform, WeightIndex, bind};

use crate::config::{ModelIndex, TransformerConfig};
use crate::error::{Error, Result};
use crate::transformer::{KEY_REMAP, ZImageTransformer2DModel};

/// How to load a component's weights.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadOptions {
    /// The float dtype every loaded float tensor is cast to; `None` keeps each file's dtype. Default: `None`, so a
    /// checkpoint runs in its stored dtype (bf16 for Z-Image-Turbo: f32 would double the host memory, 24.6 GB for
    /// the transformer alone); ask for `Some(DType::F32)` on a device that cannot compute in bf16.
    pub dtype: Option<DType>,
    /// Accept a load that leaves parameters missing or file tensors unused (they are still reported).
    /// Default: `false`.
    pub allow_partial: bool,
    /// `(regex, replacement)` renames applied to the file's tensor names before matching. Default: none.
    pub key_remap: Vec<(String, String)>,
    /// Refuse file tensors the reference implementation ignores too (a text encoder saved with its causal LM's
    /// `lm_head`), which are otherwise reported in [`LoadReport::ignored`] and loaded past. Default: `false`.
    pub strict: bool,
}

impl LoadOptions {
    /// The defaults: each file's own dtype, refuse partial loads, no renames.
    pub fn new() -> Self {
        Self::default()
    }

    /// Casts float tensors to `dtype` (`None`: keep the file's dtype).
    pub fn with_dtype(mut self, dtype: Option<DType>) -> Self {
        self.dtype = dtype;
        self
    }

    /// Accepts (`true`) or refuses (`false`) partial loads.
    pub fn with_allow_partial(mut self, allow: bool) -> Self {
        self.allow_partial = allow;
        self
    }

    /// Refuses tensors the reference ignores ([`LoadOptions::strict`]).
    pub fn with_strict(mut self, strict: bool) -> Self {
        self.strict = strict;
        self
    }

    /// Adds key renames.
    pub fn with_key_remap(mut self, remap: &[(&str, &str)]) -> Self {
        self.key_remap.extend(remap.iter().map(|(from, to)| ((*from).to_owned(), (*to).to_owned())));
        self
    }
}

/// What a load did: every module parameter is either applied or missing; every file tensor is either applied
/// or unused.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// The component (directory name) that was loaded.
    pub component: String,
    /// The safetensors files read, in order.
    pub files: Vec<PathBuf>,
    /// Parameters that received a tensor, in load order.
    pub applied: Vec<String>,
    /// Module parameters that no file provided (left at their lazy initialisation), sorted.
    pub missing: Vec<String>,
    /// File tensors that no module parameter took, sorted.
    pub unused: Vec<String>,
    /// File tensors no module parameter took that the reference implementation ignores too (a causal LM's
    /// `lm_head` beside the text encoder's weights), sorted: reported, and refused only under
    /// [`LoadOptions::strict`].
    pub ignored: Vec<String>,
    /// File tensors this crate leaves out by design (the text encoder's last decoder layer and final norm, which
    /// the pipeline's `hidden_states[-2]` never reads), sorted.
    pub skipped: Vec<String>,
}

impl LoadReport {
    /// Whether every parameter was loaded and every file tensor used.
    pub fn is_complete(&self) -> bool {
        self.missing.is_empty() && self.unused.is_empty()
    }
}

impl std::fmt::Display for LoadReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} tensors applied from {} file(s), {} missing, {} unused",
            self.component,
            self.applied.len(),
            self.files.len(),
            self.missing.len(),
            self.unused.len()
        )?;
        if !self.skipped.is_empty() {
            write!(f, ", {} skipped by design (not read by the pipeline)", self.skipped.len())?;
        }
        if !self.ignored.is_empty() {
            let first = self.ignored.first().map(String::as_str).unwrap_or_default();
            write!(f, ", {} ignored as the reference ignores them (first: {first})", self.ignored.len())?;
        }
        Ok(())
    }
}

/// A component's weights on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WeightFiles {
    /// One `*.safetensors` file.
    Single(PathBuf),
    /// Shards listed by a `*.safetensors.index.json`.
    Sharded {
        /// The index file.
        index: PathBuf,
        /// The shard files, sorted, each checked to exist.
        shards: Vec<PathBuf>,
        /// Tensor name -> shard file name, as the index lists it.
        weight_map: BTreeMap<String, String>,
    },
}

impl WeightFiles {
    /// The safetensors files to read, in order.
    pub fn files(&self) -> Vec<PathBuf> {
        match self {
            Self::Single(file) => vec![file.clone()],
            Self::Sharded { shards, .. } => shards.clone(),
        }
    }

    /// Finds the weights in `component_dir`: a `*.safetensors.index.json` (sharded) if there is one, otherwise a
    /// single `*.safetensors`. Files with a variant infix (`model.fp16.safetensors`) are used only when no plain
    /// file exists.
    pub fn find(component_dir: &Path) -> Result<Self> {
        let component = component_name(component_dir);
        let entries = std::fs::read_dir(component_dir).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                Error::MissingFile {
                    component: component.clone(),
                    what: "component directory".into(),
                    path: component_dir.to_path_buf(),
                }
            } else {
                Error::Io { path: component_dir.to_path_buf(), source }
            }
        })?;
        let mut names: Vec<String> = entries
            .filter_map(|entry| entry.ok())
            .filter(|entry| entry.path().is_file())
            .filter_map(|entry| entry.file_name().into_string().ok())
            .collect();
        names.sort();

        let pick = |suffix: &str| -> Option<String> {
            let mut candidates: Vec<&String> = names.iter().filter(|n| n.ends_with(suffix)).collect();
            // Plain names (`model.safetensors`) before variants (`model.fp16.safetensors`).
            candidates.sort_by_key(|n| (n.trim_end_matches(suffix).contains('.'), (*n).clone()));
            candidates.first().map(|n| (*n).clone())
        };

        if let Some(index_name) = pick(".safetensors.index.json") {
            let index = component_dir.join(index_name);
            let weight_map = read_weight_map(&index)?;
            let files: BTreeSet<&String> = weight_map.values().collect();
            let mut shards = Vec::with_capacity(files.len());
            for file in files {
                let shard = component_dir.join(file);
                if !shard.is_file() {
                    return Err(Error::MissingShard { index: index.clone(), file: shard });
                }
                shards.push(shard);
            }
            return Ok(Self::Sharded { index, shards, weight_map });
        }
        match pick(".safetensors") {
            Some(name) => Ok(Self::Single(component_dir.join(name))),
            None => Err(Error::MissingFile {
                component,
                what: "weights (*.safetensors)".into(),
                path: component_dir.to_path_buf(),
            }),
        }
    }
}

/// The `weight_map` of a shard index.
#[derive(Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

fn read_weight_map(index: &Path) -> Result<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(index).map_err(|source| Error::Io { path: index.to_path_buf(), source })?;
    parse_weight_map(&text, index)
}

/// Parses the text of a `*.safetensors.index.json` into its `weight_map` (tensor name -> shard file name);
/// `index` is only used in errors.
///
/// Every shard must be a plain file name in the component's directory: a name with a path separator, `..` or a
/// drive or root prefix would make the loader read a file outside the checkpoint, so it is refused with
/// [`Error::InvalidConfig`].
pub fn parse_weight_map(text: &str, index: &Path) -> Result<BTreeMap<String, String>> {
    let parsed: ShardIndex =
        serde_json::from_str(text).map_err(|source| Error::Json { path: index.to_path_buf(), source })?;
    if let Some((tensor, file)) = parsed.weight_map.iter().find(|(_, file)| !is_plain_file_name(file)) {
        return Err(Error::InvalidConfig {
            path: index.to_path_buf(),
            reason: format!(
                "weight_map puts {tensor} in {file:?}, which is not a file name inside the component directory; \
                 the index is damaged or hostile, re-download the component"
            ),
        });
    }
    Ok(parsed.weight_map)
}

/// A single normal path component: no separator, not `.` or `..`, no root or drive prefix.
fn is_plain_file_name(name: &str) -> bool {
    let mut components = Path::new(name).components();
    matches!((components.next(), components.next()), (Some(std::path::Component::Normal(part)), None) if part == name)
        && !name.contains(['/', '\\'])
}

/// The `config.json` of the component in `dir` (its name, `component`, for the error): its path, or
/// [`Error::MissingFile`] naming the file the checkpoint lacks. Read before any weight, by a model's load and by
/// its file binding alike.
pub(crate) fn config_file(dir: &Path, component: &str) -> Result<PathBuf> {
    let path = dir.join("config.json");
    if !path.is_file() {
        return Err(Error::MissingFile { component: component.to_owned(), what: "config.json".to_owned(), path });
    }
    Ok(path)
}

pub(crate) fn component_name(dir: &Path) -> String {
    dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| dir.display().to_string())
}

/// Loads the weights found in `component_dir` (see [`WeightFiles::find`]) into `module`.
///
/// The module's parameter paths (field names joined by `.`) must equal the file's tensor names after
/// [`LoadOptions::key_remap`]. On error the module may be partly loaded; drop it.
pub fn load_component<M: Module>(module: &mut M, component_dir: &Path, opts: &LoadOptions) -> Result<LoadReport> {
    let files = WeightFiles::find(component_dir)?.files();
    load_files(module, &component_name(component_dir), &files, opts)
}

/// Loads the given safetensors `files` (the shards of one component) into `module`; `component` names it in
/// reports and errors. See [`load_component`].
pub fn load_files<M: Module>(
    module: &mut M,
    component: &str,
    files: &[PathBuf],
    opts: &LoadOptions,
) -> Result<LoadReport> {
    let remapper = key_remapper(opts)?;
    let mut loaded = Loaded::new(component, files.to_vec());
    for file in files {
        loaded.apply(module, file, SafetensorsStore::from_file(file.clone()), &remapper, opts)?;
    }
    loaded.finish(opts)
}

/// Loads one safetensors container held in memory into `module`, with every check [`load_files`] makes; `file`
/// names it in reports and errors. This is the checkpoint reader without a file system, for tests and fuzzing.
///
/// The container is parsed by `safetensors`, whose header reader is bounded: a header length past the
/// container or above its 100 MB limit is refused before anything is allocated for it.
pub fn load_bytes<M: Module>(
    module: &mut M,
    component: &str,
    file: &Path,
    bytes: Vec<u8>,
    opts: &LoadOptions,
) -> Result<LoadReport> {
    let remapper = key_remapper(opts)?;
    let mut loaded = Loaded::new(component, vec![file.to_path_buf()]);
    loaded.apply(module, file, SafetensorsStore::from_bytes(Some(bytes)), &remapper, opts)?;
    loaded.finish(opts)
}

fn key_remapper(opts: &LoadOptions) -> Result<KeyRemapper> {
    KeyRemapper::from_patterns(opts.key_remap.clone()).map_err(|e| Error::InvalidKeyRemap {
        pattern: opts.key_remap.iter().map(|(from, _)| from.as_str()).collect::<Vec<_>>().join(", "),
        reason: e.to_string(),
    })
}

/// What the stores of one component's files applied, left missing and left unused, aggregated.
struct Loaded {
    report: LoadReport,
    not_applied: BTreeSet<String>,
    unused: BTreeSet<String>,
}

impl Loaded {
    fn new(component: &str, files: Vec<PathBuf>) -> Self {
        Self {
            report: LoadReport { component: component.to_owned(), files, ..LoadReport::default() },
            not_applied: BTreeSet::new(),
            unused: BTreeSet::new(),
        }
    }

    /// Applies one file's store to `module`.
    fn apply<M: Module>(
        &mut self,
        module: &mut M,
        file: &Path,
        store: SafetensorsStore,
        remapper: &KeyRemapper,
        opts: &LoadOptions,
    ) -> Result<()> {
        let store = store
            .remap(remapper.clone())
            // Every shard lacks the other shards' tensors, so each is partial; completeness is judged on the
            // aggregate below. Validation is ours too, to keep the errors typed.
            .allow_partial(true)
            .validate(false);
        let mut store = match opts.dtype {
            Some(dtype) if dtype.is_float() => store.with_from_adapter(FloatCastAdapter::to(dtype)),
            _ => store.with_from_adapter(IdentityAdapter),
        };
        let result: ApplyResult = module.load_from(&mut store).map_err(|e| store_error(file, e))?;
        if let Some(error) = result.errors.first() {
            return Err(apply_error(file, error));
        }
        self.not_applied.extend(result.missing.into_iter().map(|(path, _)| path));
        self.unused.extend(result.unused);
        self.report.applied.extend(result.applied);
        Ok(())
    }

    /// The aggregate report, or [`Error::PartialLoad`] unless partial loads are allowed.
    fn finish(self, opts: &LoadOptions) -> Result<LoadReport> {
        let mut report = self.report;
        let applied: BTreeSet<&String> = report.applied.iter().collect();
        report.missing = self.not_applied.into_iter().filter(|path| !applied.contains(path)).collect();
        report.unused = self.unused.into_iter().collect();
        if !opts.allow_partial && !report.is_complete() {
            return Err(Error::PartialLoad {
                component: report.component,
                missing: report.missing,
                unused: report.unused,
            });
        }
        Ok(report)
    }
}

fn store_error(file: &Path, error: SafetensorsStoreError) -> Error {
    match error {
        SafetensorsStoreError::Io(source) => Error::Io { path: file.to_path_buf(), source },
        other => Error::CorruptWeights { file: file.to_path_buf(), reason: other.to_string() },
    }
}

fn apply_error(file: &Path, error: &ApplyError) -> Error {
    let file = file.to_path_buf();
    match error {
        ApplyError::ShapeMismatch { path, expected, found } => {
            Error::ShapeMismatch { tensor: path.clone(), file, expected: expected.to_vec(), found: found.to_vec() }
        }
        ApplyError::DTypeMismatch { path, expected, found } => Error::DTypeMismatch {
            tensor: path.clone(),
            file,
            expected: format!("{expected:?}").to_lowercase(),
            found: format!("{found:?}").to_lowercase(),
        },
        ApplyError::AdapterError { path, message } | ApplyError::LoadError { path, message } => {
            Error::TensorLoad { tensor: path.clone(), file, reason: message.clone() }
        }
    }
}

/// A component bound to its checkpoint files (the file tier): what [`bind_component`] returns.
#[derive(Debug)]
pub struct BoundComponent<M> {
    /// The model: every parameter the files hold reads its file tensor when touched (none is read yet), the others
    /// as the model built them (allowed only under [`LoadOptions::allow_partial`]).
    pub model: M,
    /// The table of its bound parameters (each with its file, offset, stored dtype and shape): what
    /// `group_offload::ModelHandle::register_files` streams the model from, and what measures it unread.
    pub files: FileTable,
    /// What binding applied, and found missing or unused: the report [`load_component`] gives for the same files.
    pub report: LoadReport,
}

/// Binds `module`, freshly built with lazy parameters, to the weights found in `component_dir` (see
/// [`WeightFiles::find`]): the file tier's [`load_component`], which reads only the files' headers. The same key
/// renames ([`LoadOptions::key_remap`]), the same report and the same refusals: a tensor of the wrong shape is
/// [`Error::ShapeMismatch`], of the wrong kind [`Error::DTypeMismatch`], a damaged or truncated file
/// [`Error::CorruptWeights`], and a binding that leaves parameters missing or file tensors unused
/// [`Error::PartialLoad`] unless [`LoadOptions::allow_partial`]. With [`LoadOptions::dtype`] the model holds its
/// float tensors in that dtype, each read in the file's dtype and converted on the device after its upload.
pub fn bind_component<M: Module>(module: M, component_dir: &Path, opts: &LoadOptions) -> Result<BoundComponent<M>> {
    let files = WeightFiles::find(component_dir)?.files();
    bind_files(module, &component_name(component_dir), &files, opts, None)
}

/// [`bind_component`] over the given safetensors `files` (the shards of one component), `component` naming it in
/// reports and errors, with `transform` changing some tensors as they are read (quantization:
/// [`QuantizeLinearWeights`]).
pub fn bind_files<M: Module>(
    module: M,
    component: &str,
    files: &[PathBuf],
    opts: &LoadOptions,
    transform: Option<Arc<dyn TensorTransform>>,
) -> Result<BoundComponent<M>> {
    let patterns = key_remapper(opts)?.to_regex_pairs();
    // The renames burn-store's `KeyRemapper::remap` makes: every pattern that matches, in order.
    let rename = |name: &str| {
        let mut path = name.to_string();
        for (pattern, replacement) in &patterns {
            if pattern.is_match(&path) {
                path = pattern.replace_all(&path, replacement.as_str()).to_string();
            }
        }
        path
    };
    let index = WeightIndex::open(files, rename).map_err(bind_error)?;
    let mut options = BindOptions::new().with_dtype(opts.dtype.filter(DType::is_float)).with_allow_partial(true);
    if let Some(transform) = transform {
        options = options.with_transform(transform);
    }
    let (model, table, bound) = bind(module, &index, &options).map_err(bind_error)?;
    let report = LoadReport {
        component: component.to_owned(),
        files: files.to_vec(),
        applied: bound.applied,
        missing: bound.missing,
        unused: bound.unused,
        ..LoadReport::default()
    };
    if !opts.allow_partial && !report.is_complete() {
        return Err(Error::PartialLoad { component: report.component, missing: report.missing, unused: report.unused });
    }
    Ok(BoundComponent { model, files: table, report })
}

/// The loader's error for a binding's: the same variants [`load_component`] returns for the same faults.
fn bind_error(error: group_offload::Error) -> Error {
    match error {
        group_offload::Error::WeightFile { path, problem, .. } => {
            Error::CorruptWeights { file: PathBuf::from(path), reason: problem }
        }
        group_offload::Error::WeightShape { tensor, file, expected, found } => {
            Error::ShapeMismatch { tensor, file: PathBuf::from(file), expected, found }
        }
        group_offload::Error::WeightDType { tensor, file, expected, found } => {
            Error::DTypeMismatch { tensor, file: PathBuf::from(file), expected, found: found.to_lowercase() }
        }
        other => other.into(),
    }
}

/// Weight-only quantization of every `PtLinear` weight as it is read from its file, tensor by tensor (the file
/// tier's counterpart of [`crate::quantize::quantize_linear_weights`], for [`bind_files`]): each 2-D weight of a
/// [`crate::nn::PtLinear`] becomes a burn quantized tensor of `scheme` (dynamic min-max calibration), every other
/// tensor is read as the file stores it. Quantized this way a component never holds its float weights in memory:
/// each is read, quantized and dropped in turn where its group is taken apart, and the quantized bytes are what
/// the group holds (in memory, or in the disk store).
#[derive(Debug, Clone, Copy)]
pub struct QuantizeLinearWeights {
    /// The scheme the weights are quantized with.
    pub scheme: QuantScheme,
}

impl TensorTransform for QuantizeLinearWeights {
    fn target(&self, place: &TensorPlace<'_>) -> Option<DType> {
        let linear_weight = place.module == "Struct:PtLinear" && place.path.ends_with(".weight");
        (linear_weight && place.shape.len() == 2).then_some(DType::QFloat(self.scheme))
    }

    fn apply(&self, _place: &TensorPlace<'_>, data: TensorData) -> std::result::Result<TensorData, String> {
        let dtype = data.dtype();
        let weight = Tensor::<2>::from_data(data, (&Device::flex(), dtype));
        weight.quantize_dynamic(&self.scheme).try_into_data().map_err(|e| format!("{e:?}"))
    }
}

/// A validated diffusers Z-Image checkpoint directory (the layout of Tongyi-MAI/Z-Image-Turbo).
#[derive(Debug, Clone)]
pub struct Checkpoint {
    root: PathBuf,
    index: ModelIndex,
}

impl Checkpoint {
    /// Opens `dir`: it must exist and hold a `model_index.json` that declares a `ZImagePipeline` with the
    /// expected component classes.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let root = dir.as_ref().to_path_buf();
        if !root.is_dir() {
            return Err(Error::MissingDirectory { path: root });
        }
        let index_path = root.join("model_index.json");
        let index = ModelIndex::from_file(&index_path)?;
        index.validate(&index_path)?;
        Ok(Self { root, index })
    }

    /// The checkpoint directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The parsed `model_index.json`.
    pub fn model_index(&self) -> &ModelIndex {
        &self.index
    }

    /// The directory of `component` (`transformer`, `vae`, ...), checked to exist.
    pub fn component_dir(&self, component: &str) -> Result<PathBuf> {
        let dir = self.root.join(component);
        if dir.is_dir() {
            Ok(dir)
        } else {
            Err(Error::MissingFile { component: component.to_owned(), what: "component directory".into(), path: dir })
        }
    }

    /// The config file of `component`: `scheduler/scheduler_config.json` for the scheduler,
    /// `tokenizer/tokenizer_config.json` for the tokenizer, `<component>/config.json` otherwise.
    pub fn config_path(&self, component: &str) -> PathBuf {
        let name = match component {
            "scheduler" => "scheduler_config.json",
            "tokenizer" => "tokenizer_config.json",
            _ => "config.json",
        };
        self.root.join(component).join(name)
    }

    /// Reads and deserialises the config of `component` (see [`Self::config_path`]).
    pub fn read_config<T: DeserializeOwned>(&self, component: &str) -> Result<T> {
        let path = self.config_path(component);
        let text = std::fs::read_to_string(&path).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                Error::MissingFile { component: component.to_owned(), what: "config".into(), path: path.clone() }
            } else {
                Error::Io { path: path.clone(), source }
            }
        })?;
        serde_json::from_str(&text).map_err(|source| Error::Json { path, source })
    }

    /// The transformer's validated `config.json`.
    pub fn transformer_config(&self) -> Result<TransformerConfig> {
        let config: TransformerConfig = self.read_config("transformer")?;
        config.validate().map_err(|reason| Error::InvalidConfig { path: self.config_path("transformer"), reason })?;
        Ok(config)
    }

    /// The weight files of `component`.
    pub fn weight_files(&self, component: &str) -> Result<WeightFiles> {
        WeightFiles::find(&self.component_dir(component)?)
    }

    /// Loads `component`'s weights into `module` (see [`load_component`]).
    pub fn load<M: Module>(&self, component: &str, module: &mut M, opts: &LoadOptions) -> Result<LoadReport> {
        load_component(module, &self.component_dir(component)?, opts)
    }

    /// Builds the transformer from its config on `device` and binds it to its files ([`bind_component`], with
    /// [`crate::transformer::KEY_REMAP`] added to `opts`' renames): the file tier's
    /// [`load_transformer`](Self::load_transformer), which reads no weight. `transform` changes tensors as they
    /// are read ([`QuantizeLinearWeights`]).
    pub fn bind_transformer(
        &self,
        device: &Device,
        opts: &LoadOptions,
        transform: Option<Arc<dyn TensorTransform>>,
    ) -> Result<BoundComponent<ZImageTransformer2DModel>> {
        let config = self.transformer_config()?;
        let model = ZImageTransformer2DModel::new(&config, device);
        let opts = opts.clone().with_key_remap(KEY_REMAP);
        let files = self.weight_files("transformer")?.files();
        bind_files(model, "transformer", &files, &opts, transform)
    }

    /// Builds the transformer from its config on `device` and loads its weights, adding
    /// [`crate::transformer::KEY_REMAP`] to `opts`' renames.
    pub fn load_transformer(
        &self,
        device: &Device,
        opts: &LoadOptions,
    ) -> Result<(ZImageTransformer2DModel, LoadReport)> {
        let config = self.transformer_config()?;
        let mut model = ZImageTransformer2DModel::new(&config, device);
        let opts = opts.clone().with_key_remap(KEY_REMAP);
        let report = self.load("transformer", &mut model, &opts)?;
        Ok((model, report))
    }
}
