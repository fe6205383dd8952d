//! Host store: each group's parameters as one exact-size host copy, in memory, in their checkpoint file, or in
//! one safetensors file of the disk store.
//!
//! In memory, a group's tensors are the [`Bytes`] that extraction read out of the model, made shared
//! ([`Bytes::shared`]) so every upload clones a handle, never the data: one host copy per group, made once.
//!
//! In its checkpoint file (the file tier, [`crate::weights`]), a tensor is its place in the file: each upload
//! reads it with a positioned read into a buffer that becomes the upload's data, in the dtype the file stores it
//! in. A group may hold both kinds (a LoRA's low-rank factors in memory beside its layer's file tensors). Every
//! read of a group's files is timed: the engine notes it on its disk meter and in the record, and it is a
//! `file_read` span on the timeline of the thread that read it.
//!
//! On disk, a group is one safetensors file `{dir}/{model}-{hash:016x}.safetensors` whose name carries a hash
//! of the group's content: for every tensor in order, its name, dtype, shape and bytes, fed to std's
//! [`DefaultHasher`]. A file is reused only when it parses and its content hashes to the same value
//! (recomputed from the file at construction), so a stale or foreign file is never trusted; otherwise it is
//! rewritten, tensor by tensor (a file tensor is read from its checkpoint file while it is written, so no more
//! than one tensor of the group is in memory). The in-memory bytes are dropped once the file is written, and every onload reads the file again
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
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::tensor::{AllocationProperty, Bytes, DType, Device, TensorData};
use offload_core::Timeline;
use offload_core::timeline::category;

use crate::error::Error;
use crate::uploads::DeviceTensor;
use crate::weights::BoundTensor;
use std::sync::Arc;

/// One tensor of a group: what is needed to rebuild it.
#[derive(Debug, Clone)]
pub(crate) struct TensorMeta {
    /// Dotted path inside the part (`blocks.0.fc1.weight`).
    pub name: String,
    pub shape: Vec<usize>,
    /// The dtype the device holds it in.
    pub dtype: DType,
    /// The dtype of its host copy: `dtype`, but the file's for a file tensor the device holds in another float
    /// dtype (converted on the device after the upload).
    pub host_dtype: DType,
    /// The bytes the device holds: elements times the dtype's size for a float tensor; its values followed by its
    /// scales for a quantized one (burn's quantized `TensorData`, `quantized_data_len` bytes).
    pub bytes: u64,
    /// The bytes of its host copy (the same but for a file tensor converted on the device).
    pub host_bytes: u64,
}

impl TensorMeta {
    fn of(param: &ExtractedParam) -> Self {
        Self {
            name: param.dotted(),
            shape: param.shape.clone(),
            dtype: param.dtype,
            host_dtype: param.host_dtype,
            bytes: param.device_bytes,
            host_bytes: param.bytes_len(),
        }
    }

    fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// The dtype of the data an upload builds from its host copy: the quantized dtype, or the host copy's float
    /// dtype.
    pub fn data_dtype(&self) -> DType {
        if self.is_quantized() { self.dtype } else { self.host_dtype }
    }

    /// The tensor's bytes, as uploaded and charged.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether the tensor is a burn quantized tensor.
    pub fn is_quantized(&self) -> bool {
        matches!(self.dtype, DType::QFloat(_))
    }

    /// Its host copy's `bytes` as the data an upload builds from, in the host copy's dtype: a float tensor flat
    /// (installation reshapes it, a free view), a quantized one in its own shape (its scales are laid over that
    /// shape, so a reshape of a block-quantized tensor is not a view on every backend).
    pub fn upload_data(&self, bytes: Bytes) -> TensorData {
        if self.is_quantized() {
            TensorData::from_bytes(bytes, self.shape.clone(), self.dtype)
        } else {
            flat_data(bytes, self.elements(), self.data_dtype())
        }
    }

    /// How the disk store writes the tensor: its safetensors dtype and shape, and for a quantized tensor the
    /// metadata entry that keeps its real dtype and shape.
    fn stored(&self) -> Option<(safetensors::Dtype, Vec<usize>, Option<String>)> {
        if self.is_quantized() {
            let shape = self.shape.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
            return Some((
                safetensors::Dtype::U8,
                vec![self.host_bytes as usize],
                Some(format!("{:?}\n{shape}", self.dtype)),
            ));
        }
        to_safetensors(self.host_dtype).map(|dtype| (dtype, self.shape.clone(), None))
    }
}

/// A host copy that could not be read.
#[derive(Debug)]
pub(crate) enum HostReadError {
    /// A tensor's checkpoint file (the file tier): typed as it is returned ([`Error::FileRead`]).
    File(Error),
    /// The group's disk-store file.
    Disk(String),
}

impl HostReadError {
    /// The crate's error for it, `context` saying what read it (`stray load of m/g:w`).
    pub fn into_error(self, host: &GroupHost, context: &str) -> Error {
        match self {
            Self::File(error) => error,
            Self::Disk(message) => Error::Disk {
                group: host.id.clone(),
                path: host.path().map_or_else(|| "memory".to_string(), |p| p.display().to_string()),
                message: format!("{context}: {message}"),
            },
        }
    }
}

/// What an upload reads: every tensor of the group in its host copy's dtype, and the read of its files (bytes and
/// wall time), if it read any.
pub(crate) struct Loaded {
    pub data: Vec<TensorData>,
    pub read: Option<(u64, f64)>,
}

#[derive(Debug)]
enum Source {
    /// In host memory or in checkpoint files, tensor by tensor.
    Host(Vec<HostTensor>),
    /// One file of the disk store.
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
    /// The bytes of a group read from a file (its checkpoint file or its disk-store file), kept in host memory
    /// after a read within the offloader's RAM budget ([`GroupOffloadConfig::ram_budget`]): later uploads copy
    /// them instead of reading the file again. `None` for a group that reads its file at every upload.
    ///
    /// [`GroupOffloadConfig::ram_budget`]: crate::GroupOffloadConfig::ram_budget
    kept_read: parking_lot::Mutex<Option<Vec<Bytes>>>,
    /// The group's copy in a donor device's memory ([`GroupOffloadConfig::donors`]): later uploads copy it from
    /// there. `None` for a group that uploads from the host.
    ///
    /// [`GroupOffloadConfig::donors`]: crate::GroupOffloadConfig::donors
    on_donor: parking_lot::Mutex<Option<DonorCopy>>,
}

/// A group's tensors in a donor device's memory, charged to the donor's ledger, which this gives back when it is
/// dropped (the group stays resident, or its offloader ends).
pub(crate) struct DonorCopy {
    /// Which donor holds it: its index in the offloader's donors.
    pub donor: usize,
    pub tensors: Vec<DeviceTensor>,
    pub ledger: std::sync::Arc<dyn offload_core::DeviceLedger>,
    pub sizes: Vec<u64>,
}

impl Drop for DonorCopy {
    fn drop(&mut self) {
        self.ledger.free_tensors(&self.sizes);
    }
}

impl std::fmt::Debug for DonorCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DonorCopy")
            .field("donor", &self.donor)
            .field("tensors", &self.tensors.len())
            .field("sizes", &self.sizes)
            .finish()
    }
}

impl GroupHost {
    /// Each tensor's bytes, in order: a ledger that counts in a runtime's pages rounds each one up
    /// ([`DeviceLedger::allocate_tensors`](offload_core::DeviceLedger::allocate_tensors)).
    pub fn tensor_sizes(&self) -> Vec<u64> {
        self.tensors.iter().map(TensorMeta::bytes).collect()
    }

    /// The bytes of its host copy held in host memory (0 for a group in its checkpoint file or the disk store).
    pub fn memory_bytes(&self) -> u64 {
        match &self.source {
            Source::Host(tensors) => {
                tensors.iter().filter(|t| matches!(t, HostTensor::Bytes(_))).map(HostTensor::len).sum()
            }
            Source::Disk(_) => 0,
        }
    }

    /// The bytes each upload reads from checkpoint files (the file tier).
    pub fn file_bytes(&self) -> u64 {
        match &self.source {
            Source::Host(tensors) => {
                tensors.iter().filter(|t| matches!(t, HostTensor::File(_))).map(HostTensor::len).sum()
            }
            Source::Disk(_) => 0,
        }
    }

    /// A group kept in host memory (its file tensors in their files); with `stage_on`, its bytes are first handed
    /// to that device's staging ([`Device::staging`]), which moves them into page-locked memory on CUDA (one host
    /// copy still: the pageable bytes are dropped) and is a no-op on a CPU backend. A group with a file tensor is
    /// never staged: it is read again at each upload.
    pub fn in_memory(id: String, params: Vec<ExtractedParam>, stage_on: Option<&Device>) -> Self {
        let bytes = params.iter().map(|p| p.device_bytes).sum();
        let tensors: Vec<TensorMeta> = params.iter().map(TensorMeta::of).collect();
        let mut sources: Vec<HostTensor> = params.into_iter().map(|p| p.source).collect();
        let stage_on = stage_on.filter(|_| sources.iter().all(|s| matches!(s, HostTensor::Bytes(_))));
        let pinned = stage_on.is_some();
        if let Some(device) = stage_on {
            let mut staged: Vec<TensorData> = sources
                .into_iter()
                .zip(&tensors)
                .map(|(source, meta)| match source {
                    HostTensor::Bytes(bytes) => meta.upload_data(bytes),
                    // Filtered above: a staged group holds no file tensor.
                    HostTensor::File(_) => unreachable!("a group with a file tensor is not staged"),
                })
                .collect();
            device.staging(staged.iter_mut());
            sources = staged.into_iter().map(|data| HostTensor::Bytes(data.into_bytes())).collect();
        }
        let page_locked = pinned
            && sources.iter().all(|s| matches!(s, HostTensor::Bytes(b) if b.property() == AllocationProperty::Pinned));
        Self {
            id,
            tensors,
            bytes,
            pinned,
            page_locked,
            source: Source::Host(sources),
            kept_read: Default::default(),
            on_donor: Default::default(),
        }
    }

    /// A group kept in a safetensors file under `dir`, written unless a file with the same content exists. The
    /// file is written tensor by tensor: a file tensor is read from its checkpoint file as it is written (and
    /// before, once, to hash the group's content), so no more than one tensor is in memory at a time.
    pub fn on_disk(id: String, model: &str, params: Vec<ExtractedParam>, dir: &Path) -> Result<Self, HostReadError> {
        let bytes = params.iter().map(|p| p.device_bytes).sum();
        let tensors: Vec<TensorMeta> = params.iter().map(TensorMeta::of).collect();
        let sources: Vec<HostTensor> = params.into_iter().map(|p| p.source).collect();
        let mut hasher = DefaultHasher::new();
        for (meta, source) in tensors.iter().zip(&sources) {
            with_bytes(source, |data| hash_tensor(&mut hasher, &HashedMeta::of(meta), data))?;
        }
        let hash = hasher.finish();
        let path = dir.join(format!("{model}-{hash:016x}.safetensors"));
        let reusable = std::fs::read(&path).ok().is_some_and(|file| file_hash(&file) == Some(hash));
        if !reusable {
            std::fs::create_dir_all(dir)
                .map_err(|e| HostReadError::Disk(format!("creating {}: {e}", dir.display())))?;
            // Write to a temporary name and rename, so a crash never leaves a truncated file under the final name.
            let partial = path.with_extension("partial");
            write_group_file(&partial, &tensors, &sources)?;
            std::fs::rename(&partial, &path)
                .map_err(|e| HostReadError::Disk(format!("renaming {}: {e}", partial.display())))?;
            tracing::debug!(group = %id, path = %path.display(), "wrote group file");
        } else {
            tracing::debug!(group = %id, path = %path.display(), "reusing group file with the same content hash");
        }
        Ok(Self {
            id,
            tensors,
            bytes,
            pinned: false,
            page_locked: false,
            source: Source::Disk(path),
            kept_read: Default::default(),
            on_donor: Default::default(),
        })
    }

    /// The file backing the group, if it is on disk.
    pub fn path(&self) -> Option<&Path> {
        match &self.source {
            Source::Disk(path) => Some(path),
            Source::Host(_) => None,
        }
    }

    /// The name of tensor `index`, for messages.
    pub fn tensor_name(&self, index: usize) -> String {
        self.tensors.get(index).map_or_else(|| format!("{}#{index}", self.id), |t| format!("{}:{}", self.id, t.name))
    }

    /// The donor holding the group's copy (its index in the offloader's donors) and its tensors there (handles to
    /// the donor's tensors, not a copy), if it has one.
    pub fn donor_tensors(&self) -> Option<(usize, Vec<DeviceTensor>)> {
        self.on_donor.lock().as_ref().map(|copy| (copy.donor, copy.tensors.clone()))
    }

    /// The donor holding a copy of the group (its index in the offloader's donors), if any.
    pub fn donor(&self) -> Option<usize> {
        self.on_donor.lock().as_ref().map(|copy| copy.donor)
    }

    /// Whether the group has a copy on a donor.
    pub fn is_on_donor(&self) -> bool {
        self.on_donor.lock().is_some()
    }

    /// Keeps `copy` as the group's copy on its donor.
    pub fn keep_on_donor(&self, copy: DonorCopy) {
        *self.on_donor.lock() = Some(copy);
    }

    /// Drops the group's copy on its donor (given back to the donor's ledger); returns the donor's index and the
    /// copy's bytes, `None` where it had none.
    pub fn leave_donor(&self) -> Option<(usize, u64)> {
        self.on_donor.lock().take().map(|copy| (copy.donor, copy.sizes.iter().sum()))
    }

    /// The bytes of this group's read kept in host memory (0 when none is kept).
    pub fn kept_read_bytes(&self) -> u64 {
        self.kept_read.lock().as_ref().map_or(0, |kept| kept.iter().map(|b| b.len() as u64).sum())
    }

    /// Keeps a copy of `data`, the tensors an upload just read from the files, in host memory: later uploads copy
    /// it instead of reading the files. Returns the bytes kept.
    pub fn keep_read(&self, data: &[TensorData]) -> u64 {
        let kept: Vec<Bytes> = data.iter().map(|d| Bytes::from_bytes_vec(d.as_bytes().to_vec())).collect();
        let bytes = kept.iter().map(|b| b.len() as u64).sum();
        *self.kept_read.lock() = Some(kept);
        bytes
    }

    /// Drops the kept read (the group stays resident, or the offloader ends): uploads read the files again.
    /// Returns the bytes given back.
    pub fn forget_read(&self) -> u64 {
        self.kept_read.lock().take().map_or(0, |kept| kept.iter().map(|b| b.len() as u64).sum())
    }

    /// Every tensor ready for upload ([`TensorMeta::upload_data`]: float tensors flat, quantized ones in shape),
    /// and the read of its files, timed and shown on `timeline` as a `file_read` span of the thread that reads. A
    /// read kept in host memory ([`keep_read`](Self::keep_read)) is copied instead, with no read.
    pub fn load_upload(&self, timeline: &Timeline) -> Result<Loaded, HostReadError> {
        if let Some(kept) = self.kept_read.lock().as_ref() {
            let data = self.tensors.iter().zip(kept).map(|(meta, bytes)| meta.upload_data(bytes.clone())).collect();
            return Ok(Loaded { data, read: None });
        }
        match &self.source {
            Source::Host(sources) => {
                let file_bytes = self.file_bytes();
                let span =
                    (file_bytes > 0).then(|| timeline.span(category::FILE_READ, &self.id).arg("bytes", file_bytes));
                let mut seconds = 0.0;
                let mut data = Vec::with_capacity(sources.len());
                for (meta, source) in self.tensors.iter().zip(sources) {
                    let bytes = match source {
                        HostTensor::Bytes(bytes) => bytes.clone(),
                        HostTensor::File(entry) => {
                            let (buffer, took) = entry.tensor().read_bytes().map_err(HostReadError::File)?;
                            seconds += took;
                            Bytes::from_bytes_vec(buffer)
                        }
                    };
                    data.push(meta.upload_data(bytes));
                }
                drop(span);
                Ok(Loaded { data, read: (file_bytes > 0).then_some((file_bytes, seconds)) })
            }
            Source::Disk(path) => {
                let span = timeline.span(category::FILE_READ, &self.id);
                let started = Instant::now();
                let file =
                    std::fs::read(path).map_err(|e| HostReadError::Disk(format!("reading {}: {e}", path.display())))?;
                let seconds = started.elapsed().as_secs_f64();
                let read = file.len() as u64;
                drop(span.arg("bytes", read));
                let parsed = safetensors::SafeTensors::deserialize(&file)
                    .map_err(|e| HostReadError::Disk(format!("parsing {}: {e}", path.display())))?;
                let mut out = Vec::with_capacity(self.tensors.len());
                for (i, meta) in self.tensors.iter().enumerate() {
                    let view = parsed
                        .tensor(&key(i, &meta.name))
                        .map_err(|e| HostReadError::Disk(format!("{}: {e}", meta.name)))?;
                    let bytes = Bytes::from_bytes_vec(view.data().to_vec());
                    out.push(meta.upload_data(bytes));
                }
                Ok(Loaded { data: out, read: Some((read, seconds)) })
            }
        }
    }

    /// Tensor `index` with its real shape, in its host copy's dtype (used by stray loads): one tensor read, not
    /// the group's.
    pub fn load_tensor(&self, index: usize) -> Result<TensorData, HostReadError> {
        let missing = || HostReadError::Disk(format!("no tensor {index} in {}", self.id));
        let meta = self.tensors.get(index).ok_or_else(missing)?;
        let bytes = match &self.source {
            Source::Host(sources) => match sources.get(index).ok_or_else(missing)? {
                HostTensor::Bytes(bytes) => bytes.clone(),
                HostTensor::File(entry) => {
                    Bytes::from_bytes_vec(entry.tensor().read_bytes().map_err(HostReadError::File)?.0)
                }
            },
            Source::Disk(_) => {
                let data = self.load_upload(&Timeline::disabled())?.data.into_iter().nth(index).ok_or_else(missing)?;
                data.into_bytes()
            }
        };
        Ok(TensorData::from_bytes(bytes, meta.shape.clone(), meta.data_dtype()))
    }

    /// A checksum of the host copy (the same content hash the disk store uses), to show it is unchanged. A group in
    /// its checkpoint file is read for it, tensor by tensor.
    pub fn checksum(&self) -> Result<u64, String> {
        match &self.source {
            Source::Host(sources) => {
                let mut hasher = DefaultHasher::new();
                for (meta, source) in self.tensors.iter().zip(sources) {
                    with_bytes(source, |data| hash_tensor(&mut hasher, &HashedMeta::of(meta), data))
                        .map_err(|error| error.into_error(self, "checksum").to_string())?;
                }
                Ok(hasher.finish())
            }
            Source::Disk(path) => {
                let file = std::fs::read(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
                file_hash(&file).ok_or_else(|| format!("{} does not parse", path.display()))
            }
        }
    }
}

/// Calls `f` with a host tensor's bytes: borrowed from memory, or read from its checkpoint file.
fn with_bytes<R>(source: &HostTensor, f: impl FnOnce(&[u8]) -> R) -> Result<R, HostReadError> {
    match source {
        HostTensor::Bytes(bytes) => Ok(f(bytes)),
        HostTensor::File(entry) => Ok(f(&entry.tensor().read_bytes().map_err(HostReadError::File)?.0)),
    }
}

/// Writes a group's safetensors file at `path`: the header (every tensor's dtype, shape and offsets, and the real
/// dtype and shape of a quantized one), then each tensor's bytes in turn.
fn write_group_file(path: &Path, tensors: &[TensorMeta], sources: &[HostTensor]) -> Result<(), HostReadError> {
    let failed = |e: String| HostReadError::Disk(format!("writing {}: {e}", path.display()));
    let mut infos = Vec::with_capacity(tensors.len());
    let mut quantized = HashMap::new();
    let mut offset = 0usize;
    for (i, meta) in tensors.iter().enumerate() {
        let (dtype, shape, real) = meta.stored().ok_or_else(|| {
            HostReadError::Disk(format!(
                "dtype {:?} of {} cannot be stored; keep this model's groups in memory",
                meta.host_dtype, meta.name
            ))
        })?;
        if let Some(real) = real {
            quantized.insert(key(i, &meta.name), real);
        }
        let len = meta.host_bytes as usize;
        infos.push((
            key(i, &meta.name),
            safetensors::tensor::TensorInfo { dtype, shape, data_offsets: (offset, offset + len) },
        ));
        offset += len;
    }
    let metadata = safetensors::tensor::Metadata::new((!quantized.is_empty()).then_some(quantized), infos)
        .map_err(|e| failed(e.to_string()))?;
    let mut header = serde_json::to_vec(&metadata).map_err(|e| failed(e.to_string()))?;
    // safetensors pads its header with spaces to a multiple of 8 bytes, so the data that follows is aligned.
    header.resize(header.len().next_multiple_of(8), b' ');
    let file = std::fs::File::create(path).map_err(|e| failed(e.to_string()))?;
    let mut out = std::io::BufWriter::new(file);
    out.write_all(&(header.len() as u64).to_le_bytes()).map_err(|e| failed(e.to_string()))?;
    out.write_all(&header).map_err(|e| failed(e.to_string()))?;
    for (meta, source) in tensors.iter().zip(sources) {
        let written = with_bytes(source, |data| {
            if data.len() as u64 == meta.host_bytes {
                out.write_all(data).map_err(|e| e.to_string())
            } else {
                Err(format!("{} holds {} bytes where {} were expected", meta.name, data.len(), meta.host_bytes))
            }
        })?;
        written.map_err(failed)?;
    }
    out.flush().map_err(|e| failed(e.to_string()))?;
    Ok(())
}

fn key(index: usize, name: &str) -> String {
    // The index keeps keys unique and ordered even if two parameters share a dotted path.
    format!("{index:05}.{name}")
}

/// What the content hash reads of a tensor besides its bytes: its name, its host copy's dtype (as `Debug` writes
/// it) and its shape, the real ones for a quantized tensor.
struct HashedMeta<'a> {
    name: &'a str,
    dtype: String,
    shape: Vec<usize>,
}

impl<'a> HashedMeta<'a> {
    fn of(meta: &'a TensorMeta) -> Self {
        Self { name: &meta.name, dtype: format!("{:?}", meta.data_dtype()), shape: meta.shape.clone() }
    }
}

/// The content hash of a group: names, dtypes, shapes and bytes of its tensors, in order.
fn content_hash<'a>(tensors: impl Iterator<Item = (HashedMeta<'a>, &'a [u8])>) -> u64 {
    let mut hasher = DefaultHasher::new();
    for (meta, data) in tensors {
        hash_tensor(&mut hasher, &meta, data);
    }
    hasher.finish()
}

/// Feeds one tensor of a group to the content hash.
fn hash_tensor(hasher: &mut DefaultHasher, meta: &HashedMeta<'_>, data: &[u8]) {
    hasher.write(meta.name.as_bytes());
    hasher.write(meta.dtype.as_bytes());
    for dim in &meta.shape {
        hasher.write_usize(*dim);
    }
    hasher.write_usize(data.len());
    hasher.write(data);
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
            None => (format!("{:?}", crate::weights::from_safetensors(view.dtype())?), view.shape().to_vec()),
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

/// Where one parameter's host copy is.
#[derive(Debug, Clone)]
pub(crate) enum HostTensor {
    /// In host memory, shared so clones never copy: the values for a float tensor; the values followed by the
    /// scales (burn's quantized `TensorData` layout) for a quantized one.
    Bytes(Bytes),
    /// In its checkpoint file, read at each upload in the dtype the file stores it in.
    File(Arc<BoundTensor>),
}

impl HostTensor {
    /// The bytes of the host copy: what a read from its file, or a disk-store file, holds.
    pub fn len(&self) -> u64 {
        match self {
            Self::Bytes(bytes) => bytes.len() as u64,
            Self::File(entry) => entry.tensor().bytes(),
        }
    }
}

/// One float parameter as extraction found it.
pub(crate) struct ExtractedParam {
    /// Field names from the module's root to the parameter (`["blocks", "0", "fc1", "weight"]`).
    pub path: Vec<String>,
    /// For each path segment, the container type of the module that holds it (`"Struct:Block"`, `"Vec"`).
    pub containers: Vec<String>,
    pub shape: Vec<usize>,
    /// The dtype the device holds it in.
    pub dtype: DType,
    /// The dtype of its host copy: `dtype`, but the file's for a file tensor the device holds in another float
    /// dtype (converted on the device after the upload).
    pub host_dtype: DType,
    /// The bytes the device holds it in: what an upload allocates and charges.
    pub device_bytes: u64,
    /// Its host copy.
    pub source: HostTensor,
}

impl ExtractedParam {
    pub fn dotted(&self) -> String {
        self.path.join(".")
    }

    /// The bytes of its host copy.
    pub fn bytes_len(&self) -> u64 {
        self.source.len()
    }

    /// Whether its host copy is in its checkpoint file.
    pub fn is_file(&self) -> bool {
        matches!(self.source, HostTensor::File(_))
    }
}

/// Reads flat host data as a rank-1 tensor: what the worker uploads for a float parameter.
pub(crate) fn flat_data(bytes: Bytes, elements: usize, dtype: DType) -> TensorData {
    TensorData::from_bytes(bytes, [elements], dtype)
}
