//! Host store: each group's parameters as one exact-size host copy, in memory or in one safetensors file.
//!
//! In memory, a group's tensors are the [`Bytes`] that extraction read out of the model, made shared
//! ([`Bytes::shared`]) so every upload clones a handle, never the data: one host copy per group, made once.
//!
//! On disk, a group is one safetensors file `{dir}/{model}-{hash:016x}.safetensors` whose name carries a hash
//! of the group's content: for every tensor in order, its name, dtype, shape and bytes, fed to std's
//! [`DefaultHasher`]. A file is reused only when it parses and its content hashes to the same value
//! (recomputed from the file at construction), so a stale or foreign file is never trusted; otherwise it is
//! rewritten. The in-memory bytes are dropped once the file is written, and every onload reads the file again
//! (on the prefetch worker when prefetching, so off the compute thread). `DefaultHasher` is not stable across
//! Rust releases; a new toolchain only changes file names (the old files are left, not reused).
//!
//! A quantized parameter (a burn `QFloat` tensor) is kept as burn's own `TensorData` bytes, its values and scales
//! exactly as the backend read them out (never dequantized on the host). safetensors has no quantized dtype, so
//! on disk it is a `U8` tensor of those bytes, and the file's metadata keeps its real dtype (the scheme) and shape
//! under the tensor's key; the content hash reads them from there, so a quantized group's file is reused as a
//! float group's is.

use std::collections::HashMap;
use std::collections::hash_map::DefaultHasher;
use std::hash::Hasher;
use std::path::{Path, PathBuf};

use burn::tensor::{AllocationProperty, Bytes, DType, Device, TensorData};

use crate::walk::{ExtractedParam, flat_data};

/// One tensor of a group: what is needed to rebuild it.
#[derive(Debug, Clone)]
pub(crate) struct TensorMeta {
    /// Dotted path inside the part (`blocks.0.fc1.weight`).
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// The host copy's length: elements times the dtype's size for a float tensor; its values followed by its
    /// scales for a quantized one (burn's quantized `TensorData`, `quantized_data_len` bytes).
    pub bytes: u64,
}

impl TensorMeta {
    fn of(param: &ExtractedParam) -> Self {
        Self { name: param.dotted(), shape: param.shape.clone(), dtype: param.dtype, bytes: param.bytes_len() }
    }

    fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// The tensor's bytes, as uploaded and charged.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether the tensor is a burn quantized tensor.
    pub fn is_quantized(&self) -> bool {
        matches!(self.dtype, DType::QFloat(_))
    }

    /// `bytes` as the data an upload builds from: a float tensor flat (installation reshapes it, a free view),
    /// a quantized one in its own shape (its scales are laid over that shape, so a reshape of a block-quantized
    /// tensor is not a view on every backend).
    pub fn upload_data(&self, bytes: Bytes) -> TensorData {
        if self.is_quantized() {
            TensorData::from_bytes(bytes, self.shape.clone(), self.dtype)
        } else {
            flat_data(bytes, self.elements(), self.dtype)
        }
    }

    /// How the disk store writes the tensor: its safetensors dtype and shape, and for a quantized tensor the
    /// metadata entry that keeps its real dtype and shape.
    fn stored(&self) -> Option<(safetensors::Dtype, Vec<usize>, Option<String>)> {
        if self.is_quantized() {
            let shape = self.shape.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
            return Some((
                safetensors::Dtype::U8,
                vec![self.bytes as usize],
                Some(format!("{:?}\n{shape}", self.dtype)),
            ));
        }
        to_safetensors(self.dtype).map(|dtype| (dtype, self.shape.clone(), None))
    }
}

#[derive(Debug)]
enum Source {
    Memory(Vec<Bytes>),
    Disk(PathBuf),
}

/// The host copy of one group.
#[derive(Debug)]
pub(crate) struct GroupHost {
    /// The record id, `model/group`.
    pub id: String,
    pub tensors: Vec<TensorMeta>,
    /// Sum of the tensors' byte sizes: what an upload allocates.
    pub bytes: u64,
    /// Whether the host copy was staged for pinning (within the pinned budget): its uploads are copies from
    /// pinned memory, charged with [`DeviceLedger::transfer_pinned`](offload_core::DeviceLedger::transfer_pinned).
    pub pinned: bool,
    /// Whether every tensor of the staged copy is page-locked memory (`AllocationProperty::Pinned`): true on a
    /// CUDA device, false on a CPU backend, which has no page-locked memory and leaves the bytes as they are.
    pub page_locked: bool,
    source: Source,
}

impl GroupHost {
    /// Each tensor's bytes, in order: a ledger that counts in a runtime's pages rounds each one up
    /// ([`DeviceLedger::allocate_tensors`](offload_core::DeviceLedger::allocate_tensors)).
    pub fn tensor_sizes(&self) -> Vec<u64> {
        self.tensors.iter().map(TensorMeta::bytes).collect()
    }

    /// A group kept in host memory; with `stage_on`, its bytes are first handed to that device's staging
    /// ([`Device::staging`]), which moves them into page-locked memory on CUDA (one host copy still: the
    /// pageable bytes are dropped) and is a no-op on a CPU backend.
    pub fn in_memory(id: String, params: Vec<ExtractedParam>, stage_on: Option<&Device>) -> Self {
        let bytes = params.iter().map(ExtractedParam::bytes_len).sum();
        let tensors: Vec<TensorMeta> = params.iter().map(TensorMeta::of).collect();
        let mut data: Vec<Bytes> = params.into_iter().map(|p| p.bytes).collect();
        let pinned = stage_on.is_some();
        if let Some(device) = stage_on {
            let mut staged: Vec<TensorData> =
                data.into_iter().zip(&tensors).map(|(bytes, meta)| meta.upload_data(bytes)).collect();
            device.staging(staged.iter_mut());
            data = staged.into_iter().map(TensorData::into_bytes).collect();
        }
        let page_locked = pinned && data.iter().all(|b| b.property() == AllocationProperty::Pinned);
        Self { id, tensors, bytes, pinned, page_locked, source: Source::Memory(data) }
    }

    /// A group kept in a safetensors file under `dir`, written unless a file with the same content exists.
    pub fn on_disk(id: String, model: &str, params: Vec<ExtractedParam>, dir: &Path) -> Result<Self, String> {
        let bytes = params.iter().map(ExtractedParam::bytes_len).sum();
        let tensors: Vec<TensorMeta> = params.iter().map(TensorMeta::of).collect();
        let views: Vec<&[u8]> = params.iter().map(|p| &*p.bytes).collect();
        let hash =
            content_hash(tensors.iter().zip(views.iter().copied()).map(|(meta, data)| (HashedMeta::of(meta), data)));
        let path = dir.join(format!("{model}-{hash:016x}.safetensors"));
        let reusable = std::fs::read(&path).ok().is_some_and(|file| file_hash(&file) == Some(hash));
        if !reusable {
            std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
            let mut entries = Vec::with_capacity(tensors.len());
            let mut quantized = HashMap::new();
            for (i, (meta, data)) in tensors.iter().zip(views.iter().copied()).enumerate() {
                let (dtype, shape, real) = meta.stored().ok_or_else(|| {
                    format!(
                        "dtype {:?} of {} cannot be stored; keep this model's groups in memory",
                        meta.dtype, meta.name
                    )
                })?;
                let view = safetensors::tensor::TensorView::new(dtype, shape, data)
                    .map_err(|e| format!("{}: {e}", meta.name))?;
                if let Some(real) = real {
                    quantized.insert(key(i, &meta.name), real);
                }
                entries.push((key(i, &meta.name), view));
            }
            let metadata = (!quantized.is_empty()).then_some(quantized);
            // Write to a temporary name and rename, so a crash never leaves a truncated file under the final name.
            let partial = path.with_extension("partial");
            safetensors::serialize_to_file(entries, metadata, &partial).map_err(|e| format!("writing: {e}"))?;
            std::fs::rename(&partial, &path).map_err(|e| format!("renaming {}: {e}", partial.display()))?;
            tracing::debug!(group = %id, path = %path.display(), "wrote group file");
        } else {
            tracing::debug!(group = %id, path = %path.display(), "reusing group file with the same content hash");
        }
        Ok(Self { id, tensors, bytes, pinned: false, page_locked: false, source: Source::Disk(path) })
    }

    /// The file backing the group, if it is on disk.
    pub fn path(&self) -> Option<&Path> {
        match &self.source {
            Source::Disk(path) => Some(path),
            Source::Memory(_) => None,
        }
    }

    /// The name of tensor `index`, for messages.
    pub fn tensor_name(&self, index: usize) -> String {
        self.tensors.get(index).map_or_else(|| format!("{}#{index}", self.id), |t| format!("{}:{}", self.id, t.name))
    }

    /// Every tensor ready for upload ([`TensorMeta::upload_data`]: float tensors flat, quantized ones in shape).
    pub fn load_upload(&self) -> Result<Vec<TensorData>, String> {
        match &self.source {
            Source::Memory(bytes) => {
                Ok(self.tensors.iter().zip(bytes).map(|(meta, bytes)| meta.upload_data(bytes.clone())).collect())
            }
            Source::Disk(path) => {
                let file = std::fs::read(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
                let parsed = safetensors::SafeTensors::deserialize(&file)
                    .map_err(|e| format!("parsing {}: {e}", path.display()))?;
                let mut out = Vec::with_capacity(self.tensors.len());
                for (i, meta) in self.tensors.iter().enumerate() {
                    let view = parsed.tensor(&key(i, &meta.name)).map_err(|e| format!("{}: {e}", meta.name))?;
                    let bytes = Bytes::from_bytes_vec(view.data().to_vec());
                    out.push(meta.upload_data(bytes));
                }
                Ok(out)
            }
        }
    }

    /// Tensor `index` with its real shape (used by stray loads).
    pub fn load_tensor(&self, index: usize) -> Result<TensorData, String> {
        let meta = self.tensors.get(index).ok_or_else(|| format!("no tensor {index} in {}", self.id))?;
        let data =
            self.load_upload()?.into_iter().nth(index).ok_or_else(|| format!("no tensor {index} in {}", self.id))?;
        let (bytes, _, dtype) = data.into_parts();
        Ok(TensorData::from_bytes(bytes, meta.shape.clone(), dtype))
    }

    /// A checksum of the host copy (the same content hash the disk store uses), to show it is unchanged.
    pub fn checksum(&self) -> Result<u64, String> {
        match &self.source {
            Source::Memory(bytes) => Ok(content_hash(
                self.tensors.iter().zip(bytes.iter().map(|b| &**b)).map(|(meta, data)| (HashedMeta::of(meta), data)),
            )),
            Source::Disk(path) => {
                let file = std::fs::read(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
                file_hash(&file).ok_or_else(|| format!("{} does not parse", path.display()))
            }
        }
    }
}

fn key(index: usize, name: &str) -> String {
    // The index keeps keys unique and ordered even if two parameters share a dotted path.
    format!("{index:05}.{name}")
}

/// What the content hash reads of a tensor besides its bytes: its name, its dtype (as `Debug` writes it) and its
/// shape, the real ones for a quantized tensor.
struct HashedMeta<'a> {
    name: &'a str,
    dtype: String,
    shape: Vec<usize>,
}

impl<'a> HashedMeta<'a> {
    fn of(meta: &'a TensorMeta) -> Self {
        Self { name: &meta.name, dtype: format!("{:?}", meta.dtype), shape: meta.shape.clone() }
    }
}

/// The content hash of a group: names, dtypes, shapes and bytes of its tensors, in order.
fn content_hash<'a>(tensors: impl Iterator<Item = (HashedMeta<'a>, &'a [u8])>) -> u64 {
    let mut hasher = DefaultHasher::new();
    for (meta, data) in tensors {
        hasher.write(meta.name.as_bytes());
        hasher.write(meta.dtype.as_bytes());
        for dim in &meta.shape {
            hasher.write_usize(*dim);
        }
        hasher.write_usize(data.len());
        hasher.write(data);
    }
    hasher.finish()
}

/// Recomputes the content hash from a group file, or `None` if it does not parse as one. A quantized tensor's
/// real dtype and shape come from the file's metadata.
fn file_hash(file: &[u8]) -> Option<u64> {
    let parsed = safetensors::SafeTensors::deserialize(file).ok()?;
    let (_, header) = safetensors::SafeTensors::read_metadata(file).ok()?;
    let quantized = header.metadata().clone().unwrap_or_default();
    let mut names: Vec<String> = parsed.names().into_iter().map(str::to_string).collect();
    names.sort();
    let mut entries = Vec::with_capacity(names.len());
    for name in &names {
        let view = parsed.tensor(name).ok()?;
        let (_, dotted) = name.split_once('.')?;
        let (dtype, shape) = match quantized.get(name) {
            Some(real) => {
                let (dtype, shape) = real.split_once('\n')?;
                let shape = if shape.is_empty() {
                    Vec::new()
                } else {
                    shape.split(',').map(str::parse).collect::<Result<Vec<usize>, _>>().ok()?
                };
                (dtype.to_string(), shape)
            }
            None => (format!("{:?}", from_safetensors(view.dtype())?), view.shape().to_vec()),
        };
        entries.push((dotted, dtype, shape, view.data()));
    }
    Some(content_hash(
        entries
            .iter()
            .map(|(name, dtype, shape, data)| (HashedMeta { name, dtype: dtype.clone(), shape: shape.clone() }, *data)),
    ))
}

fn to_safetensors(dtype: DType) -> Option<safetensors::Dtype> {
    use safetensors::Dtype as S;
    Some(match dtype {
        DType::F64 => S::F64,
        DType::F32 | DType::Flex32 => S::F32,
        DType::F16 => S::F16,
        DType::BF16 => S::BF16,
        DType::I64 => S::I64,
        DType::I32 => S::I32,
        DType::I16 => S::I16,
        DType::I8 => S::I8,
        DType::U64 => S::U64,
        DType::U32 => S::U32,
        DType::U16 => S::U16,
        DType::U8 => S::U8,
        _ => return None,
    })
}

fn from_safetensors(dtype: safetensors::Dtype) -> Option<DType> {
    use safetensors::Dtype as S;
    Some(match dtype {
        S::F64 => DType::F64,
        S::F32 => DType::F32,
        S::F16 => DType::F16,
        S::BF16 => DType::BF16,
        S::I64 => DType::I64,
        S::I32 => DType::I32,
        S::I16 => DType::I16,
        S::I8 => DType::I8,
        S::U64 => DType::U64,
        S::U32 => DType::U32,
        S::U16 => DType::U16,
        S::U8 => DType::U8,
        _ => return None,
    })
}
