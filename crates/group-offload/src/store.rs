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
}

impl TensorMeta {
    fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// The tensor's bytes: its elements times its dtype's size.
    pub fn bytes(&self) -> u64 {
        self.elements() as u64 * self.dtype.size() as u64
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
        let tensors: Vec<TensorMeta> =
            params.iter().map(|p| TensorMeta { name: p.dotted(), shape: p.shape.clone(), dtype: p.dtype }).collect();
        let mut data: Vec<Bytes> = params.into_iter().map(|p| p.bytes).collect();
        let pinned = stage_on.is_some();
        if let Some(device) = stage_on {
            let mut staged: Vec<TensorData> = data
                .into_iter()
                .zip(&tensors)
                .map(|(bytes, meta)| flat_data(bytes, meta.elements(), meta.dtype))
                .collect();
            device.staging(staged.iter_mut());
            data = staged.into_iter().map(TensorData::into_bytes).collect();
        }
        let page_locked = pinned && data.iter().all(|b| b.property() == AllocationProperty::Pinned);
        Self { id, tensors, bytes, pinned, page_locked, source: Source::Memory(data) }
    }

    /// A group kept in a safetensors file under `dir`, written unless a file with the same content exists.
    pub fn on_disk(id: String, model: &str, params: Vec<ExtractedParam>, dir: &Path) -> Result<Self, String> {
        let bytes = params.iter().map(ExtractedParam::bytes_len).sum();
        let tensors: Vec<TensorMeta> =
            params.iter().map(|p| TensorMeta { name: p.dotted(), shape: p.shape.clone(), dtype: p.dtype }).collect();
        let views: Vec<&[u8]> = params.iter().map(|p| &*p.bytes).collect();
        let hash = content_hash(tensors.iter().zip(views.iter().copied()));
        let path = dir.join(format!("{model}-{hash:016x}.safetensors"));
        let reusable = std::fs::read(&path).ok().is_some_and(|file| file_hash(&file) == Some(hash));
        if !reusable {
            std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
            let mut entries = Vec::with_capacity(tensors.len());
            for (i, (meta, data)) in tensors.iter().zip(views.iter().copied()).enumerate() {
                let dtype = to_safetensors(meta.dtype)
                    .ok_or_else(|| format!("dtype {:?} of {} cannot be stored", meta.dtype, meta.name))?;
                let view = safetensors::tensor::TensorView::new(dtype, meta.shape.clone(), data)
                    .map_err(|e| format!("{}: {e}", meta.name))?;
                entries.push((key(i, &meta.name), view));
            }
            // Write to a temporary name and rename, so a crash never leaves a truncated file under the final name.
            let partial = path.with_extension("partial");
            safetensors::serialize_to_file(entries, None, &partial).map_err(|e| format!("writing: {e}"))?;
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

    /// Every tensor flattened to rank 1, ready for upload.
    pub fn load_flat(&self) -> Result<Vec<TensorData>, String> {
        match &self.source {
            Source::Memory(bytes) => Ok(self
                .tensors
                .iter()
                .zip(bytes)
                .map(|(meta, bytes)| flat_data(bytes.clone(), meta.elements(), meta.dtype))
                .collect()),
            Source::Disk(path) => {
                let file = std::fs::read(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
                let parsed = safetensors::SafeTensors::deserialize(&file)
                    .map_err(|e| format!("parsing {}: {e}", path.display()))?;
                let mut out = Vec::with_capacity(self.tensors.len());
                for (i, meta) in self.tensors.iter().enumerate() {
                    let view = parsed.tensor(&key(i, &meta.name)).map_err(|e| format!("{}: {e}", meta.name))?;
                    let bytes = Bytes::from_bytes_vec(view.data().to_vec());
                    out.push(flat_data(bytes, meta.elements(), meta.dtype));
                }
                Ok(out)
            }
        }
    }

    /// Tensor `index` with its real shape (used by stray loads).
    pub fn load_tensor(&self, index: usize) -> Result<TensorData, String> {
        let meta = self.tensors.get(index).ok_or_else(|| format!("no tensor {index} in {}", self.id))?;
        let flat =
            self.load_flat()?.into_iter().nth(index).ok_or_else(|| format!("no tensor {index} in {}", self.id))?;
        let (bytes, _, dtype) = flat.into_parts();
        Ok(TensorData::from_bytes(bytes, meta.shape.clone(), dtype))
    }

    /// A checksum of the host copy (the same content hash the disk store uses), to show it is unchanged.
    pub fn checksum(&self) -> Result<u64, String> {
        match &self.source {
            Source::Memory(bytes) => Ok(content_hash(self.tensors.iter().zip(bytes.iter().map(|b| &**b)))),
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

/// The content hash of a group: names, dtypes, shapes and bytes of its tensors, in order.
fn content_hash<'a>(tensors: impl Iterator<Item = (&'a TensorMeta, &'a [u8])>) -> u64 {
    let mut hasher = DefaultHasher::new();
    for (meta, data) in tensors {
        hasher.write(meta.name.as_bytes());
        hasher.write(format!("{:?}", meta.dtype).as_bytes());
        for dim in &meta.shape {
            hasher.write_usize(*dim);
        }
        hasher.write_usize(data.len());
        hasher.write(data);
    }
    hasher.finish()
}

/// Recomputes the content hash from a group file, or `None` if it does not parse as one.
fn file_hash(file: &[u8]) -> Option<u64> {
    let parsed = safetensors::SafeTensors::deserialize(file).ok()?;
    let mut names: Vec<String> = parsed.names().into_iter().map(str::to_string).collect();
    names.sort();
    let mut metas = Vec::with_capacity(names.len());
    let mut datas = Vec::with_capacity(names.len());
    for name in &names {
        let view = parsed.tensor(name).ok()?;
        let (_, dotted) = name.split_once('.')?;
        metas.push(TensorMeta {
            name: dotted.to_string(),
            shape: view.shape().to_vec(),
            dtype: from_safetensors(view.dtype())?,
        });
        datas.push(view.data());
    }
    Some(content_hash(metas.iter().zip(datas.iter().copied())))
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
