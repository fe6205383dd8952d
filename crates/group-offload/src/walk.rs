//! Module walks: taking a burn module apart into host copies (extraction) and putting device tensors back in
//! (installation), both keyed by the order in which burn visits float parameters.
//!
//! Extraction consumes the module: each float parameter's tensor is read into host `TensorData` (zero-copy on a
//! CPU backend when the tensor is not shared) and replaced by a lazy placeholder that owns no memory, so after
//! extraction the host copy is the only copy. Installation clones that skeleton (cheap: placeholders are `Arc`
//! handles) and maps every float parameter to either its group's device tensor (same [`ParamId`]) or a fresh
//! placeholder that, if some code touches it anyway, loads it synchronously and counts a stray load.
//!
//! A quantized parameter (burn's `QFloat`) is extracted as burn's own `TensorData` bytes, values and scales as the
//! backend wrote them, and uploaded in its own shape ([`DeviceTensor::Shaped`]); float parameters upload flat and
//! are reshaped at installation.
//!
//! A parameter bound to its checkpoint file ([`crate::weights`]) and still uninitialised is not read: its host
//! copy is its file tensor ([`HostTensor::File`]), read at each upload. One that its binding transforms is read and
//! transformed here, one tensor at a time, and kept as host bytes. A bound parameter something already read (it is
//! initialised) is extracted as any other: its bytes may differ from the file's (a LoRA fused into it).

use std::sync::{Arc, Weak};

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{Bool, Bytes, DType, Device, Int, Shape, Tensor, TensorData};

use crate::engine::Engine;
use crate::error::Error;
use crate::store::{ExtractedParam, GroupHost, HostTensor};
use crate::uploads::{DeviceTensor, MAX_QUANTIZED_RANK};
use crate::weights::{BoundTensor, FileTable};

/// Consumes float parameters into host copies; moves int and bool parameters to the execution device.
struct Extractor<'a> {
    stack: Vec<(String, String)>,
    params: Vec<ExtractedParam>,
    device: &'a Device,
    files: Option<&'a FileTable>,
    failure: Option<Error>,
    model: &'a str,
}

impl Extractor<'_> {
    fn dotted(&self) -> String {
        self.stack.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(".")
    }

    fn invalid(&mut self, problem: String) {
        let model = self.model.to_string();
        self.failure.get_or_insert(Error::InvalidConfig { model, problem });
    }

    /// Host bytes of `data`, a quantized tensor kept in the store its execution device holds (8-bit values stored
    /// one a byte are relabelled as packed words, their bytes unchanged: `crate::quant::repack`); `None` after a
    /// failure, which is kept.
    fn host_bytes(&mut self, data: TensorData) -> Option<(Bytes, DType)> {
        let data = match data.dtype() {
            // A scheme the device holds in no store is kept as it is: its upload is burn's to judge.
            DType::QFloat(scheme) => match crate::quant::device_scheme(&scheme, self.device) {
                Some(target) => crate::quant::repack(data, &target),
                None => Ok(data),
            },
            _ => Ok(data),
        };
        match data {
            Ok(data) => {
                let (bytes, _, dtype) = data.into_parts();
                Some((bytes.shared(), dtype))
            }
            Err(error) => {
                let path = self.dotted();
                self.invalid(format!("parameter {path}: {error}"));
                None
            }
        }
    }

    /// A parameter bound to its file and never read: its file tensor, or its transformed bytes when its binding
    /// transforms it (read and transformed now).
    fn bound(&mut self, entry: &Arc<BoundTensor>, files: &FileTable) -> Option<(HostTensor, DType, u64)> {
        if !entry.is_transformed() {
            let device_bytes = entry.bytes_on(Some(self.device));
            return Some((HostTensor::File(entry.clone()), entry.stored(), device_bytes));
        }
        let data = match files.read_entry(entry) {
            Ok((data, _)) => data,
            Err(error) => {
                self.failure.get_or_insert(error);
                return None;
            }
        };
        if matches!(data.dtype(), DType::QFloat(_)) && data.shape().num_dims() > MAX_QUANTIZED_RANK {
            let path = self.dotted();
            self.invalid(format!(
                "parameter {path} is quantized by its binding's transform with rank {}; group offload uploads \
                 quantized parameters in their own shape up to rank {MAX_QUANTIZED_RANK}: leave it out of the \
                 transform",
                data.shape().num_dims()
            ));
            return None;
        }
        let (bytes, dtype) = self.host_bytes(data)?;
        let len = bytes.len() as u64;
        Some((HostTensor::Bytes(bytes), dtype, len))
    }
}

impl ModuleMapper for Extractor<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.stack.push((name.to_string(), container_type.to_string()));
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.stack.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let id = param.id;
        let bound = self.files.and_then(|files| Some((files.get(id)?.clone(), files)));
        if let Some((entry, files)) = bound.filter(|_| !param.is_initialized()) {
            // The parameter's initialiser is dropped unread: its host copy is its file tensor.
            drop(param);
            let shape = entry.shape().to_vec();
            let (source, host_dtype, device_bytes) = match self.bound(&entry, files) {
                Some(found) => found,
                None => (HostTensor::Bytes(Bytes::from_bytes_vec(Vec::new())), DType::F32, 0),
            };
            let dtype = if matches!(source, HostTensor::File(_)) { entry.dtype() } else { host_dtype };
            self.params.push(ExtractedParam {
                path: self.stack.iter().map(|(n, _)| n.clone()).collect(),
                containers: self.stack.iter().map(|(_, c)| c.clone()).collect(),
                shape: shape.clone(),
                dtype,
                host_dtype,
                device_bytes,
                source,
            });
            return empty_placeholder(id, shape, self.device);
        }
        let tensor = param.into_value();
        let shape = tensor.shape().as_slice().to_vec();
        let (bytes, dtype) = match tensor.try_into_data() {
            Ok(data) if matches!(data.dtype(), DType::QFloat(_)) && D > MAX_QUANTIZED_RANK => {
                let path = self.dotted();
                self.invalid(format!(
                    "parameter {path} is quantized ({:?}) with rank {D}; group offload uploads quantized parameters \
                     in their own shape up to rank {MAX_QUANTIZED_RANK}, so move this module whole (component \
                     offload) or leave this parameter unquantized",
                    data.dtype()
                ));
                (Bytes::from_bytes_vec(Vec::new()), DType::F32)
            }
            Ok(data) => self.host_bytes(data).unwrap_or_else(|| (Bytes::from_bytes_vec(Vec::new()), DType::F32)),
            Err(error) => {
                let path = self.dotted();
                self.invalid(format!("reading parameter {path} to the host failed: {error:?}"));
                (Bytes::from_bytes_vec(Vec::new()), DType::F32)
            }
        };
        let device_bytes = bytes.len() as u64;
        self.params.push(ExtractedParam {
            path: self.stack.iter().map(|(n, _)| n.clone()).collect(),
            containers: self.stack.iter().map(|(_, c)| c.clone()).collect(),
            shape: shape.clone(),
            dtype,
            host_dtype: dtype,
            device_bytes,
            source: HostTensor::Bytes(bytes),
        });
        empty_placeholder(id, shape, self.device)
    }

    fn map_int<const D: usize>(&mut self, param: Param<Tensor<D, Int>>) -> Param<Tensor<D, Int>> {
        let device = self.device.clone();
        param.map(|t| t.to_device(&device))
    }

    fn map_bool<const D: usize>(&mut self, param: Param<Tensor<D, Bool>>) -> Param<Tensor<D, Bool>> {
        let device = self.device.clone();
        param.map(|t| t.to_device(&device))
    }
}

/// Every float parameter of `module` with its field path, the container type of each segment and its bytes
/// ([`param_bytes`](crate::whole::param_bytes) `exec`: values and scales for a quantized one, in the store `exec`
/// holds them in; a parameter bound to its file sized from `files`), read without touching the data.
pub(crate) fn param_places<M: Module>(
    module: &M,
    exec: Option<&Device>,
    files: Option<&FileTable>,
) -> Vec<(Vec<String>, Vec<String>, u64)> {
    struct Places<'a> {
        stack: Vec<(String, String)>,
        params: Vec<(Vec<String>, Vec<String>, u64)>,
        exec: Option<&'a Device>,
        files: Option<&'a FileTable>,
    }
    impl burn::module::ModuleVisitor for Places<'_> {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            self.stack.push((name.to_string(), container_type.to_string()));
        }

        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.stack.pop();
        }

        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let bytes = crate::whole::param_bytes(param, self.exec, self.files);
            self.params.push((
                self.stack.iter().map(|(n, _)| n.clone()).collect(),
                self.stack.iter().map(|(_, c)| c.clone()).collect(),
                bytes,
            ));
        }
    }
    let mut places = Places { stack: Vec::new(), params: Vec::new(), exec, files };
    module.visit(&mut places);
    places.params
}

/// A placeholder that is never initialised: the skeleton is private and every installation replaces it.
fn empty_placeholder<const D: usize>(id: ParamId, shape: Vec<usize>, device: &Device) -> Param<Tensor<D>> {
    let lazy_shape = Shape::from(shape.clone());
    Param::uninitialized(
        id,
        move |dev: &Device, _| Tensor::zeros(Shape::from(shape), dev),
        device.clone(),
        false,
        lazy_shape,
    )
}

/// Takes `module` apart: returns its skeleton and its float parameters in visit order. A parameter bound in
/// `files` and never read keeps its file tensor as its host copy. `model` names the offloader in errors.
pub(crate) fn extract<M: Module>(
    module: M,
    device: &Device,
    files: Option<&FileTable>,
    model: &str,
) -> Result<(M, Vec<ExtractedParam>), Error> {
    let mut extractor = Extractor { stack: Vec::new(), params: Vec::new(), device, files, failure: None, model };
    let skeleton = module.map(&mut extractor);
    match extractor.failure {
        Some(failure) => Err(failure),
        None => Ok((skeleton, extractor.params)),
    }
}

/// Where a parameter's data lives: its group and its index among the group's tensors.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Slot {
    /// Index of the group in the engine.
    pub group: usize,
    /// Index of the tensor in the group.
    pub index: usize,
}

/// What an installation can see: the uploaded tensors of some groups, and everything needed for a stray load.
pub(crate) struct Installed<'a> {
    /// `(group index, its device tensors)` for the groups this guard holds.
    pub groups: &'a [(usize, Arc<[DeviceTensor]>)],
    /// The host copy of every group of the part, by engine group index.
    pub hosts: &'a dyn Fn(usize) -> Option<Arc<GroupHost>>,
    /// The engine a touched placeholder reports to (weakly: a placeholder may outlive it): it counts the stray
    /// load, and records a host copy it cannot read (a disk file removed under a running model) as the error the
    /// call fails with.
    pub engine: Weak<Engine>,
    pub device: &'a Device,
}

struct Installer<'a, 'b> {
    slots: &'a [Slot],
    next: usize,
    installed: &'a Installed<'b>,
}

impl ModuleMapper for Installer<'_, '_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let id = param.id;
        let shape = param.lazy_shape();
        let ordinal = self.next;
        self.next += 1;
        let Some(slot) = self.slots.get(ordinal).copied() else {
            return param;
        };
        let uploaded =
            self.installed.groups.iter().find(|(g, _)| *g == slot.group).and_then(|(_, t)| t.get(slot.index));
        match uploaded {
            Some(DeviceTensor::Flat(flat)) => {
                let mut dims = [0usize; D];
                for (d, s) in dims.iter_mut().zip(shape.as_slice()) {
                    *d = *s;
                }
                return Param::initialized(id, flat.clone().reshape(dims));
            }
            Some(DeviceTensor::Shaped(tensor)) => {
                // Uploaded with the parameter's own shape, so its rank is `D`; were it not, the placeholder below
                // loads it and counts a stray load, which the streaming check reports.
                if let Some(tensor) = tensor.downcast_ref::<Tensor<D>>() {
                    return Param::initialized(id, tensor.clone());
                }
            }
            None => {}
        }
        // Not in this guard's groups: a fresh placeholder (never the skeleton's, so a stray load cannot leak
        // into the skeleton) that loads the parameter on its own if the model touches it.
        let Some(host) = (self.installed.hosts)(slot.group) else {
            return param;
        };
        let engine = self.installed.engine.clone();
        let index = slot.index;
        let zeros_shape = shape.clone();
        Param::uninitialized(
            id,
            move |dev: &Device, _| {
                let name = host.tensor_name(index);
                let engine = engine.upgrade();
                if let Some(engine) = &engine {
                    engine.count_stray(&name);
                }
                let target = host.tensors.get(index).map_or(DType::F32, |meta| meta.dtype);
                match host.load_tensor(index) {
                    Ok(data) => {
                        let dims = data.shape().as_slice().to_vec();
                        let dtype = data.dtype();
                        let tensor = Tensor::<D>::from_data(data, (dev, dtype)).reshape(Shape::from(dims));
                        // A file tensor the device holds in another float dtype is converted here, as its upload
                        // converts it.
                        if dtype == target { tensor } else { tensor.cast(target) }
                    }
                    // A placeholder has no way to return an error: the failure is recorded, the call that made it
                    // returns it typed once its forward ends (its output is never used), and the parameter
                    // reads as zeros of its shape and dtype until then.
                    Err(error) => {
                        if let Some(engine) = &engine {
                            engine.fail_stray(error.into_error(&host, &format!("stray load of {name}")));
                        }
                        let dtype = if matches!(target, DType::QFloat(_)) { DType::F32 } else { target };
                        Tensor::<D>::zeros(zeros_shape.clone(), (dev, dtype))
                    }
                }
            },
            self.installed.device.clone(),
            false,
            shape,
        )
    }
}

/// Builds a device-resident copy of `skeleton`: parameters of installed groups get their device tensors, the
/// others self-loading placeholders. `slots` maps the skeleton's float parameters, in visit order, to groups.
pub(crate) fn install<M: Module>(skeleton: &M, slots: &[Slot], installed: &Installed<'_>) -> M {
    let mut installer = Installer { slots, next: 0, installed };
    skeleton.clone().map(&mut installer)
}
