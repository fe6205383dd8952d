//! Whole-component moves: a burn module as an `offload-core` component ([`BurnComponent`]), moved between the
//! host and the execution device by the `ComponentsManager`, with every byte reported to a [`DeviceLedger`] (a
//! simulated card, or nothing on a real device), on the [`OffloadDevice`] it computes on.
//!
//! On a real accelerator `onload` is `Module::to_device(accelerator)` followed by a sync, which is where burn's
//! cubecl backends report an out-of-memory ([`crate::device::check_device`] types it); `offload` drops the device
//! copy. Each call runs through [`crate::device::run_call`], so it reports success only once the
//! device has done its work. On the CPU with a simulated card (`--card 8GB`) the weights stay in host memory,
//! and the card is charged for them and for each run's activations, so a tiny checkpoint exercises the
//! manager's real decisions, real OOM retries and real output.

use std::sync::Arc;

use crate::device::{
    CallMeasure, DeviceOutput, catch_device_panic, check_device, check_outputs, measure_call, run_call,
};
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{DType, Device, Tensor};

use crate::OffloadDevice;
pub use crate::quant::bytes_of;
use crate::weights::{BoundTensor, FileTable};
use offload_core::link::LinkSample;
use offload_core::plan::CallPages;
use offload_core::{ComponentError, DeviceLedger, DeviceMemory, DeviceName, Direction, Offloadable};

/// Bytes of a module's float parameters, at their current dtypes (a quantized tensor's values and scales).
pub fn module_bytes<M: Module>(module: &M) -> u64 {
    module_bytes_on(module, None)
}

/// [`module_bytes`] as `exec` holds the module ([`tensor_bytes_on`]); `None`: as it is.
pub fn module_bytes_on<M: Module>(module: &M, exec: Option<&Device>) -> u64 {
    module_bytes_with(module, exec, None)
}

/// [`module_bytes_on`] of a model bound to its checkpoint files: each parameter still bound (uninitialised) is
/// counted from `files` ([`FileTable`]) without reading it; the others as they are.
pub fn module_bytes_with<M: Module>(module: &M, exec: Option<&Device>, files: Option<&FileTable>) -> u64 {
    module_tensor_sizes_with(module, exec, files).iter().sum()
}

/// Bytes of each of a module's float parameters, in visiting order: what a ledger that counts in a runtime's
/// pages rounds one by one ([`DeviceLedger::allocate_tensors`]).
pub fn module_tensor_sizes<M: Module>(module: &M) -> Vec<u64> {
    module_tensor_sizes_on(module, None)
}

/// [`module_tensor_sizes`] as `exec` holds the module ([`tensor_bytes_on`]); `None`: as it is.
pub fn module_tensor_sizes_on<M: Module>(module: &M, exec: Option<&Device>) -> Vec<u64> {
    module_tensor_sizes_with(module, exec, None)
}

/// [`module_tensor_sizes_on`] of a model bound to its checkpoint files: a parameter still bound is sized from
/// `files` ([`param_bytes`]), so measuring a bound model reads none of its weights.
pub fn module_tensor_sizes_with<M: Module>(module: &M, exec: Option<&Device>, files: Option<&FileTable>) -> Vec<u64> {
    struct Sizes<'a>(Vec<u64>, Option<&'a Device>, Option<&'a FileTable>);
    impl ModuleVisitor for Sizes<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param_bytes(param, self.1, self.2));
        }
    }
    let mut sizes = Sizes(Vec::new(), exec, files);
    module.visit(&mut sizes);
    sizes.0
}

/// The bytes of one float parameter as `exec` holds it: from `files` when it is bound to a file tensor and still
/// uninitialised (nothing is read), from its tensor otherwise ([`tensor_bytes_on`], which reads it into memory if
/// it is lazy).
pub fn param_bytes<const D: usize>(param: &Param<Tensor<D>>, exec: Option<&Device>, files: Option<&FileTable>) -> u64 {
    match bound(param, files) {
        Some(entry) => entry.bytes_on(exec),
        None => tensor_bytes_on(&param.val(), exec),
    }
}

/// The dtype one float parameter holds: from `files` when it is bound and uninitialised, from its tensor
/// otherwise.
pub fn param_dtype<const D: usize>(param: &Param<Tensor<D>>, files: Option<&FileTable>) -> DType {
    match bound(param, files) {
        Some(entry) => entry.dtype(),
        None => param.val().dtype(),
    }
}

/// `param`'s file tensor, when it is bound in `files` and nothing read it yet.
fn bound<'a, const D: usize>(param: &Param<Tensor<D>>, files: Option<&'a FileTable>) -> Option<&'a Arc<BoundTensor>> {
    if param.is_initialized() {
        return None;
    }
    files?.get(param.id)
}

/// Bytes of one float tensor at its dtype; for a quantized tensor, its values and scales (its dtype's size is
/// one storage word, not bytes per value): `quantized_data_len`, the length of burn's quantized `TensorData`,
/// which is what group offload's host copy of it holds, moves and charges.
pub fn tensor_bytes<const D: usize>(tensor: &Tensor<D>) -> u64 {
    tensor_bytes_on(tensor, None)
}

/// [`tensor_bytes`] as `exec` holds the tensor: a quantized tensor in the store `exec` keeps it in
/// ([`crate::quant::device_scheme`]: 4-bit values `flex` stores one a byte take half a byte each packed on wgpu),
/// which is what every move to `exec`, whole or by group, uploads and charges; `None`: as it is.
pub fn tensor_bytes_on<const D: usize>(tensor: &Tensor<D>, exec: Option<&Device>) -> u64 {
    bytes_of(&tensor.shape(), tensor.dtype(), exec)
}

/// Whether any of a module's float parameters is a burn quantized tensor.
pub fn module_is_quantized<M: Module>(module: &M) -> bool {
    module_is_quantized_with(module, None)
}

/// [`module_is_quantized`] of a model bound to its checkpoint files: a bound parameter counts as quantized when
/// its binding's transform quantizes it ([`param_dtype`]); nothing is read.
pub fn module_is_quantized_with<M: Module>(module: &M, files: Option<&FileTable>) -> bool {
    struct Quantized<'a>(bool, Option<&'a FileTable>);
    impl ModuleVisitor for Quantized<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0 |= matches!(param_dtype(param, self.1), DType::QFloat(_));
        }
    }
    let mut quantized = Quantized(false, files);
    module.visit(&mut quantized);
    quantized.0
}

/// A module's float parameters as a call's output: reading one value of each back proves every upload landed.
struct Parameters<'a, M>(&'a M);

impl<M: Module> DeviceOutput for Parameters<'_, M> {
    fn probes(&self) -> Vec<Tensor<1>> {
        struct Probes(Vec<Tensor<1>>);
        impl ModuleVisitor for Probes {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let tensor = param.val();
                // A quantized tensor is read back by its own kernels; its bytes moved with the others.
                if !matches!(tensor.dtype(), DType::QFloat(_)) {
                    self.0.extend(tensor.probes());
                }
            }
        }
        let mut probes = Probes(Vec::new());
        self.0.visit(&mut probes);
        probes.0
    }
}

/// A burn module the manager can move: its weights, its size and where it is.
///
/// The host copy stays while the component is on a device: inference never changes weights, so an offload drops
/// the device copy (no copy back, and the device memory is free at once) instead of moving the module back with
/// `to_device`. That matters on burn 0.22: a cross-device `to_device` is lazy, and the host tensor it returns
/// keeps the device buffer alive until it is first read (measured on wgpu: a 64 MiB tensor moved to the host and
/// dropped on the device stayed in the pool's bytes in use, and reading it allocated 64 MiB more there).
pub struct BurnComponent<M: Module> {
    /// The host copy, always there.
    module: M,
    /// The device copy while the component is on an execution device other than the host's backend.
    resident: Option<M>,
    bytes: u64,
    /// The size of each parameter, for a ledger that counts in pages.
    sizes: Vec<u64>,
    placement: OffloadDevice,
    device: DeviceName,
    class_name: &'static str,
    /// The pages its weights took at its first whole onload onto a device that pages (`None` before).
    footprint: Option<u64>,
    /// What its calls took on such a device, measured at its second call at an estimate.
    calls: CallMeasure,
}

impl<M: Module> std::fmt::Debug for BurnComponent<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BurnComponent").field("class", &self.class_name).field("bytes", &self.bytes).finish()
    }
}

impl<M: Module + 'static> BurnComponent<M> {
    /// Wraps a module that is on `placement.host()`; its sizes are those the execution device holds it in
    /// ([`module_tensor_sizes_on`]).
    pub fn new(module: M, class_name: &'static str, placement: OffloadDevice) -> Self {
        let sizes = module_tensor_sizes_on(&module, Some(placement.exec()));
        let bytes = sizes.iter().sum();
        Self {
            module,
            resident: None,
            bytes,
            sizes,
            placement,
            device: DeviceName::cpu(),
            class_name,
            footprint: None,
            calls: CallMeasure::default(),
        }
    }

    /// The module's host copy, for reading.
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The burn device the module computes on now.
    pub fn burn_device(&self) -> &Device {
        if self.device.is_cpu() { self.placement.host() } else { self.placement.exec() }
    }

    /// Runs `f` on the module with `activation_bytes` accounted on the ledger for the call: the entry point the
    /// manager wraps ([`crate::device::run_call`]). `f`'s own error becomes the component's (a group upload's
    /// out-of-memory stays typed, so the manager's OOM retry sees it).
    ///
    /// On the ledger of a simulated card in hard mode the charge fails with out-of-memory when the card is
    /// full, exactly like a real allocation; on a real device the call succeeds only once the device has done
    /// its work, and its out-of-memory (or a hard cap's) is typed. The manager's OOM retry then makes room and
    /// calls again.
    pub fn run<R: DeviceOutput, E: Into<ComponentError>>(
        &mut self,
        activation_bytes: u64,
        f: impl FnOnce(&M, &Device) -> Result<R, E>,
    ) -> Result<R, ComponentError> {
        let device = self.burn_device().clone();
        let placement = &self.placement;
        // The copy that computes now: the device copy while resident on a device, the host copy otherwise.
        let module = self.resident.as_ref().unwrap_or(&self.module);
        let memory = placement.memory().as_deref();
        // The weights are all on the device before the call: its second call at an estimate measures its pages.
        measure_call(&device, memory, &mut self.calls, activation_bytes, || {
            run_call(placement, &device, activation_bytes, || f(module, &device).map_err(Into::into))
        })
    }

    /// Takes the module back, for use outside the manager.
    pub fn into_module(self) -> M {
        self.module
    }

    fn same_burn_device(&self) -> bool {
        self.placement.exec() == self.placement.host()
    }
}

impl<M: Module + 'static> Offloadable for BurnComponent<M> {
    fn bytes(&self) -> u64 {
        self.bytes
    }

    fn device(&self) -> DeviceName {
        self.device.clone()
    }

    fn onload(&mut self, device: &DeviceName) -> Result<(), ComponentError> {
        let ledger = self.placement.ledger().clone();
        // Each parameter is its own allocation on the device: a ledger in pages rounds each one.
        ledger.allocate_tensors(&self.sizes)?;
        // From here every way out but success gives the reservation back: an error, and a panic that is not the
        // device's (a ledger's, a host read's), which `catch_device_panic` lets unwind through this frame.
        let reservation = Reservation { ledger: ledger.as_ref(), sizes: &self.sizes, kept: false };
        ledger.transfer(self.bytes, Direction::HostToDevice)?;
        if !self.same_burn_device() {
            let exec = self.placement.exec();
            let memory = self.placement.memory().as_deref();
            let held = || memory.and_then(|m| m.held().ok().flatten());
            // The first onload onto a device that allocates in pages measures the footprint: the pool's pages
            // after the onload less before, its cache released first so that the weights take pages of their own.
            let held_before = if self.footprint.is_none() && held().is_some() {
                self.placement.memory_cleanup();
                held()
            } else {
                None
            };
            let copy_started = std::time::Instant::now();
            let checked = if crate::device::defers_failures(exec) {
                // On a cubecl runtime the copy runs on the device's upload thread, whose stream holds the groups
                // streamed on that device too: the footprint measured here is then in the pools those groups use.
                let (module, exec, name, what) = (self.module.clone(), exec.clone(), device.clone(), self.class_name);
                let memory = self.placement.memory().clone();
                self.placement
                    .on_upload_thread(move || copy_checked(module, &exec, &name, what, memory.as_deref()))
                    .unwrap_or_else(|error| {
                        Err(ComponentError::Transfer {
                            what: format!("{} to {device}", self.class_name),
                            message: error.to_string(),
                        })
                    })
            } else {
                copy_checked(self.module.clone(), exec, device, self.class_name, memory)
            };
            match checked {
                Ok(moved) => {
                    reservation.keep();
                    // From the first copy to the synced read-back: the whole onload's time on the link.
                    let seconds = copy_started.elapsed().as_secs_f64();
                    self.placement.link().note(LinkSample { bytes: self.bytes, seconds, page_locked: false });
                    self.resident = Some(moved);
                    // The read-back probes (one small tensor per parameter) each took a page of the pool: give
                    // them back, so the component's call starts from its weights (measured on wgpu: about a
                    // third of a megabyte of pages for the tiny transformer's probes, kept until the next
                    // release otherwise). They were made on the upload thread, in its stream's pool: both
                    // streams are cleaned.
                    self.placement.memory_cleanup();
                    if let (Some(before), Some(after)) = (held_before, held()) {
                        self.footprint = Some(after.saturating_sub(before)).filter(|&bytes| bytes > 0);
                    }
                }
                Err(error) => {
                    drop(reservation);
                    tracing::warn!(device = %device, "onload failed: {error}");
                    // The component's size is what this onload asked for, whatever allocation failed first.
                    return Err(match error {
                        ComponentError::OutOfMemory { device, available, .. } => {
                            ComponentError::OutOfMemory { device, requested: self.bytes, available }
                        }
                        other => other,
                    });
                }
            }
        } else {
            reservation.keep();
        }
        self.device = device.clone();
        Ok(())
    }

    fn offload(&mut self) -> Result<(), ComponentError> {
        self.placement.ledger().transfer(self.bytes, Direction::DeviceToHost)?;
        if self.resident.take().is_some() {
            // As diffusers clears the device cache after an offload: the pages the weights held go back to the
            // device, so the next component (or a capped device's next call) can have them.
            self.placement.memory_cleanup();
        }
        self.placement.ledger().free_tensors(&self.sizes);
        self.device = DeviceName::cpu();
        Ok(())
    }

    fn class_name(&self) -> String {
        self.class_name.to_string()
    }

    fn device_footprint(&self) -> Option<u64> {
        self.footprint
    }

    fn call_footprint(&self) -> Option<CallPages> {
        self.calls.footprint()
    }
}

/// A whole onload's reservation on its ledger, given back when it is dropped unless it was kept: the onload's
/// errors and a panic unwinding through it (a ledger's or a host read's, not the device's, which
/// [`catch_device_panic`] types) free what `allocate_tensors` took, so the account never keeps a reservation for
/// weights that are not on the device (later refusals would be false out-of-memories).
struct Reservation<'a> {
    ledger: &'a dyn DeviceLedger,
    sizes: &'a [u64],
    kept: bool,
}

impl Reservation<'_> {
    /// The weights are on the device: the reservation stays until the offload frees it.
    fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.kept {
            self.ledger.free_tensors(self.sizes);
        }
    }
}

/// Copies `module` to `exec` and waits for the copy: the parameters read back one value each, so that an allocation
/// the runtime refused surfaces now, typed (cubecl reports it at the next sync, not at the allocating call).
fn copy_checked<M: Module>(
    module: M,
    exec: &Device,
    device: &DeviceName,
    what: &str,
    memory: Option<&dyn DeviceMemory>,
) -> Result<M, ComponentError> {
    // Quantized parameters the device holds only in its packed store are repacked on the way (their bytes, never
    // dequantized: `crate::quant::module_to_device`).
    match catch_device_panic(|| crate::quant::module_to_device(module, exec)) {
        Ok(Err(message)) => Err(ComponentError::Transfer { what: format!("{what} to {device}"), message }),
        Ok(Ok(moved)) => check_device(exec, device, "onload", memory)
            .and_then(|()| check_outputs(&Parameters(&moved), exec, device, "onload", memory))
            .map(|()| moved),
        Err(panic) => Err(panic.with_device(device, "onload", memory)),
    }
}
