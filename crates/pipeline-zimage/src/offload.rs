//! Burn modules as `offload-core` components: moved between the host and the execution device by the
//! `ComponentsManager`, with every byte reported to a [`DeviceLedger`] (a simulated card, or nothing on a real
//! device).
//!
//! On a real accelerator `onload` is `Module::to_device(accelerator)` followed by a sync, which is where burn's
//! CUDA backend reports an out-of-memory; `offload` is `to_device(host)`. On the CPU with a simulated card
//! (`--card 8GB`) the weights stay in host memory, and the card is charged for them and for each run's
//! activations, so a tiny checkpoint exercises the manager's real decisions, real OOM retries and real output.

use std::sync::Arc;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::quantization::quantized_data_len;
use burn::tensor::{DType, Device, Tensor};
use offload_core::{ComponentError, DeviceLedger, DeviceName, Direction, Offloadable};

/// Bytes of a module's float parameters, at their current dtypes (a quantized tensor's values and scales).
pub fn module_bytes<M: Module>(module: &M) -> u64 {
    struct Bytes(u64);
    impl ModuleVisitor for Bytes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0 += tensor_bytes(&param.val());
        }
    }
    let mut bytes = Bytes(0);
    module.visit(&mut bytes);
    bytes.0
}

/// Bytes of one float tensor at its dtype; for a quantized tensor, its values and scales (its dtype's size is
/// one storage word, not bytes per value).
pub fn tensor_bytes<const D: usize>(tensor: &Tensor<D>) -> u64 {
    let shape = tensor.shape();
    let bytes = match tensor.dtype() {
        DType::QFloat(scheme) => quantized_data_len(&scheme, &shape),
        dtype => shape.num_elements() * dtype.size(),
    };
    bytes as u64
}

/// Where a component executes: the burn device that computes, the name the manager knows it by, and the
/// ledger that accounts for it.
#[derive(Clone)]
pub struct Placement {
    /// The burn device that runs the component (`Device::cuda(0)`, or `Device::flex()` under a simulated card).
    pub exec: Device,
    /// The burn device offloaded weights live on.
    pub host: Device,
    /// The execution device's name in the manager (`cuda:0`).
    pub name: DeviceName,
    /// Accounting of the execution device.
    pub ledger: Arc<dyn DeviceLedger>,
}

impl std::fmt::Debug for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Placement").field("exec", &self.exec).field("name", &self.name).finish()
    }
}

/// A burn module the manager can move: its weights, its size and where it is.
pub struct BurnComponent<M: Module> {
    module: M,
    bytes: u64,
    placement: Placement,
    device: DeviceName,
    class_name: &'static str,
}

impl<M: Module> std::fmt::Debug for BurnComponent<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BurnComponent").field("class", &self.class_name).field("bytes", &self.bytes).finish()
    }
}

impl<M: Module + 'static> BurnComponent<M> {
    /// Wraps a module that is on `placement.host`.
    pub fn new(module: M, class_name: &'static str, placement: Placement) -> Self {
        let bytes = module_bytes(&module);
        Self { module, bytes, placement, device: DeviceName::cpu(), class_name }
    }

    /// The module, for reading.
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The burn device the module computes on now.
    pub fn burn_device(&self) -> &Device {
        if self.device.is_cpu() { &self.placement.host } else { &self.placement.exec }
    }

    /// Runs `f` on the module with `activation_bytes` charged to the ledger for the call: the entry point the
    /// manager wraps.
    ///
    /// On the ledger of a simulated card in hard mode the charge fails with out-of-memory when the card is
    /// full, exactly like a real allocation; the manager's OOM retry then makes room and calls again.
    pub fn run<R>(
        &mut self,
        activation_bytes: u64,
        f: impl FnOnce(&M, &Device) -> crate::Result<R>,
    ) -> Result<R, ComponentError> {
        self.placement.ledger.allocate(activation_bytes)?;
        let device = self.burn_device().clone();
        let result = f(&self.module, &device);
        self.placement.ledger.free(activation_bytes);
        result.map_err(ComponentError::other)
    }

    /// Takes the module back, for use outside the manager.
    pub fn into_module(self) -> M {
        self.module
    }

    fn same_burn_device(&self) -> bool {
        self.placement.exec == self.placement.host
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
        let ledger = self.placement.ledger.clone();
        ledger.allocate(self.bytes)?;
        if let Err(error) = ledger.transfer(self.bytes, Direction::HostToDevice) {
            ledger.free(self.bytes);
            return Err(error);
        }
        if !self.same_burn_device() {
            let moved = self.module.clone().to_device(&self.placement.exec);
            // burn's CUDA backend reports an allocation failure at the next sync, not at the allocating call.
            if let Err(error) = self.placement.exec.sync() {
                ledger.free(self.bytes);
                tracing::warn!(device = %device, "device sync after onload failed: {error:?}");
                return Err(ComponentError::OutOfMemory {
                    device: device.clone(),
                    requested: self.bytes,
                    available: 0,
                });
            }
            self.module = moved;
        }
        self.device = device.clone();
        Ok(())
    }

    fn offload(&mut self) -> Result<(), ComponentError> {
        self.placement.ledger.transfer(self.bytes, Direction::DeviceToHost)?;
        if !self.same_burn_device() {
            self.module = self.module.clone().to_device(&self.placement.host);
        }
        self.placement.ledger.free(self.bytes);
        self.device = DeviceName::cpu();
        Ok(())
    }

    fn class_name(&self) -> String {
        self.class_name.to_string()
    }
}

/// Readings of a device treated as large enough for everything: with auto offload enabled on it, every
/// component is onloaded on its first run and never evicted. It is how a pipeline keeps everything resident on
/// a real device while every move still goes through the manager and its record.
#[derive(Debug, Clone)]
pub struct Unbounded {
    /// The device the readings stand for.
    pub device: DeviceName,
}

impl offload_core::DeviceMemory for Unbounded {
    fn device(&self) -> DeviceName {
        self.device.clone()
    }

    fn total(&self) -> u64 {
        u64::MAX / 2
    }

    fn available(&self) -> u64 {
        u64::MAX / 2
    }

    fn allocated(&self) -> u64 {
        0
    }

    fn peak(&self) -> u64 {
        0
    }
}
