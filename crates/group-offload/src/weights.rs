//! The file tier: a model whose host copy is its checkpoint file.
//!
//! A model crate opens a component's safetensors files as a [`WeightIndex`] (only their headers are read:
//! bounded by safetensors' 100 MB header limit, the data never mapped or read), with a rename function for the
//! keys its modules do not match as they are. [`bind`] then binds a freshly built model to the index: every float
//! parameter the files hold is replaced by an uninitialised one with the same [`ParamId`], whose initialiser
//! reads that tensor from the file (so anything that touches it by accident reads the right bytes, and is counted
//! in the [`FileTable`], rather than random numbers). Shapes and dtypes are checked, the key set reported
//! ([`BindReport`]: applied, missing, unused), and no tensor data is read. The [`FileTable`] maps each bound
//! parameter to its file tensor: the sizes of a bound model come from it without reading a byte
//! (`whole::module_tensor_sizes_with`, `model::measure_layout_with`), and group offload's host
//! copy of a bound parameter is its file tensor, read with positioned reads (`FileExt::read_exact_at`, no
//! `unsafe`, no map) each time its group is uploaded ([`crate::ModelHandle::register_files`]).
//!
//! Tensors are read in the dtype the file stores them in: there is no conversion on the copy path. A model bound
//! with [`BindOptions::dtype`] holds each float tensor in that dtype, converted on the device after the upload. A
//! [`TensorTransform`] (quantization, say) is applied tensor by tensor where a group is taken apart, its result
//! kept in host memory or written to the disk store: never the whole float model at once.
//!
//! The page cache is the tier's memory: a read the kernel serves from it is a memory copy, and the kernel takes
//! the pages back when the process needs them. Every group's read is timed on a [`DiskMeter`] (bytes, seconds),
//! a `file_read` span on the timeline of the thread that made it and the record's `from file` column.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{Bool, DType, Device, Int, Shape, Tensor, TensorData};
use offload_core::link::{DiskMeter, DiskSample};
use parking_lot::Mutex;

use crate::error::{Error, Result};

/// safetensors' bound on a header's length (its `MAX_HEADER_SIZE`): a longer header is refused before anything
/// is allocated for it.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// How many names of parameters read through their initialisers a table keeps.
const TOUCHED_KEPT: usize = 16;

/// One open checkpoint file.
#[derive(Debug)]
struct WeightFile {
    path: PathBuf,
    file: File,
}

/// One tensor of a checkpoint file: where its bytes are, what they hold.
#[derive(Debug, Clone)]
pub struct FileTensor {
    file: Arc<WeightFile>,
    name: String,
    offset: u64,
    bytes: u64,
    stored: safetensors::Dtype,
    dtype: Option<DType>,
    shape: Vec<usize>,
}

impl FileTensor {
    /// The file that holds it.
    pub fn path(&self) -> &Path {
        &self.file.path
    }

    /// Its name in the file (before any rename).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where its bytes start in the file (past the header).
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Its bytes in the file.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The dtype the file stores it in, as burn names it; `None` for a dtype burn does not read (`F8_E4M3`).
    pub fn dtype(&self) -> Option<DType> {
        self.dtype
    }

    /// Its shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Its bytes, read with one positioned read, and the read's wall time in seconds. A short file (truncated
    /// after it was opened) is [`Error::FileRead`].
    pub fn read_bytes(&self) -> Result<(Vec<u8>, f64)> {
        let len = usize::try_from(self.bytes).map_err(|_| self.read_error("it does not fit in memory".into()))?;
        // A zeroed allocation of this size comes from fresh pages the read fills: no copy of zeros is made.
        let mut buffer = vec![0u8; len];
        let started = Instant::now();
        self.file.file.read_exact_at(&mut buffer, self.offset).map_err(|e| self.read_error(e.to_string()))?;
        Ok((buffer, started.elapsed().as_secs_f64()))
    }

    /// The tensor as the file stores it (its dtype and shape), with the read's wall time in seconds.
    pub fn read(&self) -> Result<(TensorData, f64)> {
        let dtype = self.dtype.ok_or_else(|| self.read_error(format!("burn reads no {:?} tensor", self.stored)))?;
        let (bytes, seconds) = self.read_bytes()?;
        Ok((TensorData::from_bytes_vec(bytes, self.shape.clone(), dtype), seconds))
    }

    fn read_error(&self, message: String) -> Error {
        Error::FileRead {
            tensor: self.name.clone(),
            file: self.file.path.display().to_string(),
            offset: self.offset,
            bytes: self.bytes,
            message,
        }
    }
}

/// The tensors of a set of safetensors files (a component's shards), by the names a model's parameters have:
/// each file's name passed through the rename function [`WeightIndex::open`] was given.
#[derive(Debug, Clone, Default)]
pub struct WeightIndex {
    files: Vec<PathBuf>,
    tensors: BTreeMap<String, FileTensor>,
}

impl WeightIndex {
    /// Opens `files` and reads their headers: each tensor's name (passed through `rename`), dtype, shape and
    /// place in its file. No tensor data is read. Refused with [`Error::WeightFile`] when a file cannot be
    /// opened, is shorter than its header says (truncated), holds bytes past its last tensor, has a header past
    /// [`MAX_HEADER_BYTES`] or one that does not parse, or when two tensors reach the same name (in two shards, or
    /// through the rename).
    pub fn open(files: &[PathBuf], rename: impl Fn(&str) -> String) -> Result<Self> {
        let mut index = Self { files: files.to_vec(), tensors: BTreeMap::new() };
        let mut origin: HashMap<String, String> = HashMap::new();
        for path in files {
            let refused = |problem: String| Error::WeightFile {
                path: path.display().to_string(),
                problem,
                fix: "re-download it, or check that the path names the component's weights".into(),
            };
            let file = File::open(path).map_err(|e| refused(format!("it cannot be opened: {e}")))?;
            let len = file.metadata().map_err(|e| refused(format!("its size cannot be read: {e}")))?.len();
            let mut prefix = [0u8; 8];
            if len < 8 {
                return Err(refused(format!("it holds {len} bytes, fewer than a safetensors header's length")));
            }
            file.read_exact_at(&mut prefix, 0).map_err(|e| refused(format!("its header cannot be read: {e}")))?;
            let header_len = u64::from_le_bytes(prefix);
            if header_len > MAX_HEADER_BYTES {
                return Err(refused(format!(
                    "its header claims {header_len} bytes, past safetensors' limit of {MAX_HEADER_BYTES}"
                )));
            }
            if 8 + header_len > len {
                return Err(refused(format!(
                    "its header claims {header_len} bytes but the file holds {len}: it is truncated"
                )));
            }
            let mut header = vec![0u8; header_len as usize];
            file.read_exact_at(&mut header, 8).map_err(|e| refused(format!("its header cannot be read: {e}")))?;
            let metadata: safetensors::tensor::Metadata = serde_json::from_slice(&header)
                .map_err(|e| refused(format!("its header does not parse as safetensors: {e}")))?;
            let data_start = 8 + header_len;
            let data_len = metadata.data_len() as u64;
            if data_start + data_len != len {
                let problem = if data_start + data_len > len {
                    format!(
                        "its header lists {data_len} bytes of tensors but the file holds {} after the header: it is \
                         truncated",
                        len - data_start
                    )
                } else {
                    format!("it holds {} bytes past its last tensor", len - data_start - data_len)
                };
                return Err(refused(problem));
            }
            let file = Arc::new(WeightFile { path: path.clone(), file });
            let mut names: Vec<(String, &safetensors::tensor::TensorInfo)> = metadata.tensors().into_iter().collect();
            names.sort_by(|a, b| a.0.cmp(&b.0));
            for (name, info) in names {
                let key = rename(&name);
                let here = format!("{name} in {}", path.display());
                if let Some(first) = origin.insert(key.clone(), here.clone()) {
                    return Err(Error::WeightFile {
                        path: path.display().to_string(),
                        problem: format!(
                            "its tensor {name} is named {key} after the key renames, as {first} is: the renames map \
                             two tensors to one parameter"
                        ),
                        fix: "fix the renames, or the shard list if a shard is given twice".into(),
                    });
                }
                let (start, end) = info.data_offsets;
                index.tensors.insert(
                    key,
                    FileTensor {
                        file: file.clone(),
                        name,
                        offset: data_start + start as u64,
                        bytes: (end - start) as u64,
                        stored: info.dtype,
                        dtype: from_safetensors(info.dtype),
                        shape: info.shape.clone(),
                    },
                );
            }
        }
        Ok(index)
    }

    /// The files, in the order given.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// The tensor a parameter named `key` reads.
    pub fn get(&self, key: &str) -> Option<&FileTensor> {
        self.tensors.get(key)
    }

    /// Every tensor's name (after renames), sorted.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// How many tensors the files hold.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the files hold no tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The bytes of every tensor in the files.
    pub fn bytes(&self) -> u64 {
        self.tensors.values().map(|t| t.bytes).sum()
    }
}

/// Where a parameter sits, for a [`TensorTransform`] to decide on.
#[derive(Debug, Clone, Copy)]
pub struct TensorPlace<'a> {
    /// Its dotted path in the model (`layers.0.attention.to_q.weight`).
    pub path: &'a str,
    /// The container type of the module that holds it (`Struct:PtLinear`).
    pub module: &'a str,
    /// Its shape.
    pub shape: &'a [usize],
    /// The dtype it is read in (the file's).
    pub dtype: DType,
}

/// A change made to some of a bound model's tensors as they are read (weight-only quantization, say), tensor by
/// tensor: [`apply`](Self::apply) runs where a group is taken apart (its result kept in host memory, or written to
/// the disk store) and where a parameter is read through its initialiser. [`target`](Self::target) says, before
/// any read, what each tensor becomes, so that every size (the plan's, the ledger's) is the transformed one.
pub trait TensorTransform: Send + Sync {
    /// The dtype the tensor at `place` becomes, or `None` to leave it as the file stores it.
    fn target(&self, place: &TensorPlace<'_>) -> Option<DType>;

    /// The tensor at `place` transformed; called only where [`target`](Self::target) gave `Some`, and its result
    /// must have that dtype. An error names what went wrong.
    fn apply(&self, place: &TensorPlace<'_>, data: TensorData) -> std::result::Result<TensorData, String>;
}

/// How [`bind`] binds a model.
#[derive(Clone, Default)]
pub struct BindOptions {
    /// The float dtype the model holds its tensors in: each float tensor is read in the file's dtype and converted
    /// on the device after the upload. `None` (the default) keeps the file's.
    pub dtype: Option<DType>,
    /// Accept a binding that leaves parameters missing or file tensors unused (they are still reported). Default:
    /// `false`, which refuses one with [`Error::PartialBind`].
    pub allow_partial: bool,
    /// A change made to some tensors as they are read ([`TensorTransform`]); none by default.
    pub transform: Option<Arc<dyn TensorTransform>>,
}

impl std::fmt::Debug for BindOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BindOptions")
            .field("dtype", &self.dtype)
            .field("allow_partial", &self.allow_partial)
            .field("transform", &self.transform.is_some())
            .finish()
    }
}

impl BindOptions {
    /// The defaults: the file's dtypes, partial bindings refused, no transform.
    pub fn new() -> Self {
        Self::default()
    }

    /// Holds float tensors in `dtype` (`None`: the file's).
    pub fn with_dtype(mut self, dtype: Option<DType>) -> Self {
        self.dtype = dtype;
        self
    }

    /// Accepts (`true`) or refuses (`false`) a partial binding.
    pub fn with_allow_partial(mut self, allow: bool) -> Self {
        self.allow_partial = allow;
        self
    }

    /// Transforms tensors as they are read.
    pub fn with_transform(mut self, transform: Arc<dyn TensorTransform>) -> Self {
        self.transform = Some(transform);
        self
    }
}

/// What a binding did: every parameter of the model is applied (bound to a file tensor) or missing; every file
/// tensor is applied or unused.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BindReport {
    /// The files of the index.
    pub files: Vec<PathBuf>,
    /// Parameters bound to a file tensor, in the model's order.
    pub applied: Vec<String>,
    /// Parameters no file holds (left as the model built them), sorted.
    pub missing: Vec<String>,
    /// File tensors no parameter took, sorted.
    pub unused: Vec<String>,
}

impl BindReport {
    /// Whether every parameter was bound and every file tensor used.
    pub fn is_complete(&self) -> bool {
        self.missing.is_empty() && self.unused.is_empty()
    }
}

/// A parameter bound to its file tensor.
#[derive(Debug)]
pub struct BoundTensor {
    path: String,
    module: String,
    tensor: FileTensor,
    dtype: DType,
    transformed: bool,
}

impl BoundTensor {
    /// The parameter's dotted path in the model.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The file tensor it reads.
    pub fn tensor(&self) -> &FileTensor {
        &self.tensor
    }

    /// The dtype the model holds it in: the file's, the bind's float dtype, or its transform's target.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The dtype the file stores it in.
    pub fn stored(&self) -> DType {
        // Bound only when burn reads the file's dtype ([`bind`] refuses the others).
        self.tensor.dtype.unwrap_or(self.dtype)
    }

    /// Whether a [`TensorTransform`] changes it as it is read.
    pub fn is_transformed(&self) -> bool {
        self.transformed
    }

    /// Its shape.
    pub fn shape(&self) -> &[usize] {
        &self.tensor.shape
    }

    /// The bytes it takes as `exec` holds it (`None`: as the model holds it): what its group charges and moves,
    /// with no read ([`crate::quant::bytes_of`]).
    pub fn bytes_on(&self, exec: Option<&Device>) -> u64 {
        crate::quant::bytes_of(&Shape::from(self.tensor.shape.clone()), self.dtype, exec)
    }

    /// The place a transform decides on.
    fn place(&self) -> TensorPlace<'_> {
        TensorPlace { path: &self.path, module: &self.module, shape: &self.tensor.shape, dtype: self.stored() }
    }
}

/// What a table shares with the initialisers of its parameters.
struct TableShared {
    meter: Arc<DiskMeter>,
    transform: Option<Arc<dyn TensorTransform>>,
    touched: Mutex<Touched>,
}

#[derive(Default)]
struct Touched {
    count: u64,
    names: Vec<String>,
    failure: Option<Error>,
}

/// The parameters of a bound model, by [`ParamId`], each with its file tensor: what measures the model without
/// reading it and what group offload reads its host copies from. Cloning shares it.
///
/// It owns the disk meter every read of these files is timed on (a group's upload, a parameter read through its
/// initialiser), and counts the parameters that were read through their initialisers: a bound model streamed by
/// group offload reads none that way, so a count above zero names a weight something touched outside its group.
#[derive(Clone)]
pub struct FileTable {
    params: Arc<HashMap<ParamId, Arc<BoundTensor>>>,
    shared: Arc<TableShared>,
}

impl std::fmt::Debug for FileTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileTable").field("params", &self.params.len()).field("bytes", &self.bytes()).finish()
    }
}

impl FileTable {
    /// The file tensor of the parameter `id`, if it is bound.
    pub fn get(&self, id: ParamId) -> Option<&Arc<BoundTensor>> {
        self.params.get(&id)
    }

    /// How many parameters are bound.
    pub fn len(&self) -> usize {
        self.params.len()
    }

    /// Whether no parameter is bound.
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// The bytes of the bound parameters as the model holds them.
    pub fn bytes(&self) -> u64 {
        self.params.values().map(|p| p.bytes_on(None)).sum()
    }

    /// The disk meter every read of these files is timed on.
    pub fn meter(&self) -> &Arc<DiskMeter> {
        &self.shared.meter
    }

    /// The transform applied as tensors are read, if any.
    pub fn transform(&self) -> Option<&Arc<dyn TensorTransform>> {
        self.shared.transform.as_ref()
    }

    /// How many parameters were read through their initialisers (touched outside group offload), and the first
    /// ones' paths.
    pub fn materialised(&self) -> (u64, Vec<String>) {
        let touched = self.shared.touched.lock();
        (touched.count, touched.names.clone())
    }

    /// The first read through an initialiser that failed since the last call, cleared: the parameter read zeros
    /// instead, so the call that touched it must fail with this error.
    pub fn take_failure(&self) -> Option<Error> {
        self.shared.touched.lock().failure.take()
    }

    /// `entry`'s data as the model holds it before any cast: read from its file (noted on the meter) and
    /// transformed when its binding says so.
    pub(crate) fn read_entry(&self, entry: &BoundTensor) -> Result<(TensorData, f64)> {
        read_entry(&self.shared, entry)
    }
}

fn read_entry(shared: &TableShared, entry: &BoundTensor) -> Result<(TensorData, f64)> {
    let (data, seconds) = entry.tensor.read()?;
    shared.meter.note(DiskSample { bytes: entry.tensor.bytes, seconds });
    if !entry.transformed {
        return Ok((data, seconds));
    }
    let Some(transform) = &shared.transform else { return Ok((data, seconds)) };
    let data = transform
        .apply(&entry.place(), data)
        .map_err(|message| Error::Transform { tensor: entry.path.clone(), message })?;
    if data.dtype() != entry.dtype {
        return Err(Error::Transform {
            tensor: entry.path.clone(),
            message: format!("it gave {:?} where its target said {:?}", data.dtype(), entry.dtype),
        });
    }
    Ok((data, seconds))
}

/// The parameter `entry` as a tensor on `device`, read through its initialiser: counted, and on a failure
/// recorded and read as zeros (the call that touched it then fails with the recorded error).
fn materialise<const D: usize>(shared: &TableShared, entry: &BoundTensor, device: &Device) -> Tensor<D> {
    {
        let mut touched = shared.touched.lock();
        touched.count += 1;
        if touched.names.len() < TOUCHED_KEPT {
            touched.names.push(entry.path.clone());
        }
    }
    tracing::debug!(parameter = entry.path.as_str(), "a file-bound parameter was read through its initialiser");
    match read_entry(shared, entry) {
        Ok((data, _)) => {
            let dtype = data.dtype();
            let tensor = Tensor::<D>::from_data(data, (device, dtype));
            if dtype == entry.dtype { tensor } else { tensor.cast(entry.dtype) }
        }
        Err(error) => {
            tracing::error!(parameter = entry.path.as_str(), "a file-bound parameter could not be read: {error}");
            shared.touched.lock().failure.get_or_insert(error);
            let dtype = if matches!(entry.dtype, DType::QFloat(_)) { DType::F32 } else { entry.dtype };
            Tensor::<D>::zeros(Shape::from(entry.tensor.shape.clone()), (device, dtype))
        }
    }
}

/// Reads every parameter of a bound `model` that is still unread from its file (through `table`: its transform
/// and dtype applied, each read timed on the table's meter) into an initialised tensor on `device`: the model in
/// host memory, as a load through burn-store gives it (the RAM tier), with the same `ParamId`s. These reads are the
/// load itself, not parameters touched by accident, so they are not counted in [`FileTable::materialised`].
/// The first read that fails is returned, typed, and the model is dropped.
pub fn materialize<M: Module>(model: M, table: &FileTable, device: &Device) -> Result<M> {
    struct Reader<'a> {
        table: &'a FileTable,
        device: &'a Device,
        failure: Option<Error>,
    }
    impl ModuleMapper for Reader<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if param.is_initialized() || self.failure.is_some() {
                return param;
            }
            let Some(entry) = self.table.get(param.id).cloned() else { return param };
            match self.table.read_entry(&entry) {
                Ok((data, _)) => {
                    let dtype = data.dtype();
                    let tensor = Tensor::<D>::from_data(data, (self.device, dtype));
                    let tensor = if dtype == entry.dtype { tensor } else { tensor.cast(entry.dtype) };
                    Param::initialized(param.id, tensor)
                }
                Err(error) => {
                    self.failure = Some(error);
                    param
                }
            }
        }
    }
    let mut reader = Reader { table, device, failure: None };
    let model = model.map(&mut reader);
    match reader.failure {
        Some(error) => Err(error),
        None => Ok(model),
    }
}

/// Binds `model` to `index`: every float parameter the index holds under its path becomes an uninitialised
/// parameter (same [`ParamId`]) that reads its file tensor when touched, and is entered in the returned
/// [`FileTable`]; int and bool parameters the index holds are read now (they are small and never streamed).
/// Nothing else is read. Parameters the index does not hold are left as the model built them.
///
/// Register the bound model with [`ModelHandle::register_files`](crate::ModelHandle::register_files), never with
/// `ModelHandle::register`: a model moved whole by burn's `to_device` (and sized without the table) reads every
/// parameter into memory, which is what the file tier exists to avoid. Measure it with the table
/// (`whole::module_bytes_with`, `model::measure_layout_with`); the functions without it read it.
///
/// Refused with [`Error::WeightShape`] when a tensor's shape is not the parameter's, [`Error::WeightDType`] when
/// its dtype is not one a parameter of that kind holds; with [`Error::PartialBind`] when parameters are missing or file tensors unused,
/// unless [`BindOptions::allow_partial`].
pub fn bind<M: Module>(model: M, index: &WeightIndex, options: &BindOptions) -> Result<(M, FileTable, BindReport)> {
    let shared = Arc::new(TableShared {
        meter: Arc::default(),
        transform: options.transform.clone(),
        touched: Mutex::new(Touched::default()),
    });
    let mut binder = Binder {
        index,
        options,
        shared: shared.clone(),
        stack: Vec::new(),
        params: HashMap::new(),
        applied: Vec::new(),
        missing: Vec::new(),
        failure: None,
    };
    let model = model.map(&mut binder);
    if let Some(failure) = binder.failure {
        return Err(failure);
    }
    let applied: std::collections::HashSet<&str> = binder.applied.iter().map(String::as_str).collect();
    let mut report = BindReport {
        files: index.files.clone(),
        unused: index.keys().filter(|key| !applied.contains(key)).map(str::to_string).collect(),
        applied: binder.applied.clone(),
        missing: std::mem::take(&mut binder.missing),
    };
    report.missing.sort();
    if !options.allow_partial && !report.is_complete() {
        return Err(Error::PartialBind { missing: report.missing, unused: report.unused });
    }
    Ok((model, FileTable { params: Arc::new(binder.params), shared }, report))
}

struct Binder<'a> {
    index: &'a WeightIndex,
    options: &'a BindOptions,
    shared: Arc<TableShared>,
    stack: Vec<(String, String)>,
    params: HashMap<ParamId, Arc<BoundTensor>>,
    applied: Vec<String>,
    missing: Vec<String>,
    failure: Option<Error>,
}

impl Binder<'_> {
    fn path(&self) -> String {
        self.stack.iter().map(|(name, _)| name.as_str()).collect::<Vec<_>>().join(".")
    }

    /// The file tensor of the parameter at the current path, checked against its `shape` and `kind`
    /// (`"float"`, `"int"`, `"bool"`); `None` when the index does not hold it (then it is missing) or when it
    /// fails a check (then the failure is kept).
    fn find(&mut self, shape: &Shape, kind: &str, fits: impl Fn(DType) -> bool) -> Option<(String, FileTensor)> {
        let path = self.path();
        let Some(tensor) = self.index.get(&path) else {
            self.missing.push(path);
            return None;
        };
        let file = tensor.path().display().to_string();
        let failure = if tensor.shape != shape.as_slice() {
            Some(Error::WeightShape {
                tensor: path.clone(),
                file,
                expected: shape.as_slice().to_vec(),
                found: tensor.shape.clone(),
            })
        } else {
            match tensor.dtype {
                Some(dtype) if fits(dtype) => None,
                _ => Some(Error::WeightDType {
                    tensor: path.clone(),
                    file,
                    expected: kind.to_string(),
                    found: format!("{:?}", tensor.stored),
                }),
            }
        };
        if let Some(failure) = failure {
            self.failure.get_or_insert(failure);
            return None;
        }
        self.applied.push(path.clone());
        Some((path, tensor.clone()))
    }
}

impl ModuleMapper for Binder<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.stack.push((name.to_string(), container_type.to_string()));
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.stack.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let shape = param.lazy_shape();
        let Some((path, tensor)) = self.find(&shape, "float", |dtype| dtype.is_float()) else { return param };
        // The last segment is the parameter's field, entered with the type of the module that holds it.
        let module = self.stack.last().map(|(_, container)| container.clone()).unwrap_or_default();
        let stored = tensor.dtype.unwrap_or(DType::F32);
        let place = TensorPlace { path: &path, module: &module, shape: &tensor.shape, dtype: stored };
        let target = self.options.transform.as_ref().and_then(|t| t.target(&place));
        let dtype = target.unwrap_or_else(|| self.options.dtype.filter(DType::is_float).unwrap_or(stored));
        let entry = Arc::new(BoundTensor { path, module, tensor, dtype, transformed: target.is_some() });
        let id = param.id;
        let device = param.lazy_device();
        self.params.insert(id, entry.clone());
        let shared = self.shared.clone();
        Param::uninitialized(id, move |device: &Device, _| materialise(&shared, &entry, device), device, false, shape)
    }

    fn map_int<const D: usize>(&mut self, param: Param<Tensor<D, Int>>) -> Param<Tensor<D, Int>> {
        let shape = param.lazy_shape();
        let Some((_, tensor)) = self.find(&shape, "int", |dtype| dtype.is_int() || dtype.is_uint()) else {
            return param;
        };
        match tensor.read() {
            Ok((data, _)) => {
                let device = param.lazy_device();
                Param::initialized(param.id, Tensor::<D, Int>::from_data(data, &device))
            }
            Err(error) => {
                self.failure.get_or_insert(error);
                param
            }
        }
    }

    fn map_bool<const D: usize>(&mut self, param: Param<Tensor<D, Bool>>) -> Param<Tensor<D, Bool>> {
        let shape = param.lazy_shape();
        let Some((_, tensor)) = self.find(&shape, "bool", |dtype| dtype.is_bool()) else {
            return param;
        };
        match tensor.read() {
            Ok((data, _)) => {
                let device = param.lazy_device();
                Param::initialized(param.id, Tensor::<D, Bool>::from_data(data, &device))
            }
            Err(error) => {
                self.failure.get_or_insert(error);
                param
            }
        }
    }
}

/// burn's dtype for a safetensors dtype it reads.
pub(crate) fn from_safetensors(dtype: safetensors::Dtype) -> Option<DType> {
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
        S::BOOL => DType::Bool(burn::tensor::BoolStore::Native),
        _ => return None,
    })
}
