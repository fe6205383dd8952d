//! The adapter that lets a [`ComponentsManager`](offload_core::ComponentsManager) hold a group-offloaded model
//! without ever evicting it wholesale.

use offload_core::{ComponentError, DeviceName, Offloadable};

use crate::error::Error;
use crate::parts::GroupOffload;

/// A group-offloaded model as an [`Offloadable`] component: it reports
/// [`evictable`](Offloadable::evictable) `= false`, its resident bytes (resident parts plus the
/// resident budget) and its window ([`window_bytes`](Offloadable::window_bytes)), so the manager counts it and
/// makes room for what it streams, but its strategy never picks it; the model streams its own groups.
///
/// `onload` uploads the resident parts (and fails for any device other than the prepared one); `offload`
/// drops every group from the device.
#[derive(Debug, Clone)]
pub struct GroupOffloadedModel {
    offload: GroupOffload,
    active: bool,
}

impl GroupOffloadedModel {
    /// Wraps an offloader; it starts "on the host" for the manager.
    pub fn new(offload: GroupOffload) -> Self {
        Self { offload, active: false }
    }

    /// The offloader, to run the model.
    pub fn offload(&self) -> &GroupOffload {
        &self.offload
    }
}

impl Offloadable for GroupOffloadedModel {
    fn bytes(&self) -> u64 {
        self.offload.total_bytes()
    }

    fn device(&self) -> DeviceName {
        if self.active { self.offload.config().device.name().clone() } else { DeviceName::cpu() }
    }

    fn onload(&mut self, device: &DeviceName) -> Result<(), ComponentError> {
        let config = self.offload.config();
        if device != config.device.name() {
            return Err(Error::WrongDevice {
                model: config.model.clone(),
                prepared: config.device.name().to_string(),
                requested: device.to_string(),
            }
            .into());
        }
        self.offload.onload_resident()?;
        self.active = true;
        Ok(())
    }

    fn offload(&mut self) -> Result<(), ComponentError> {
        self.offload.offload_all()?;
        // As a component offloaded whole does, and as diffusers clears the device cache after an offload: the
        // pages the groups held go back to the device, so the next component's onload can have them (measured on
        // wgpu: without it, the decode's pages came on top of the released transformer's).
        self.offload.config().device.memory_cleanup();
        self.active = false;
        Ok(())
    }

    fn resident_bytes(&self) -> u64 {
        self.offload.resident_bytes()
    }

    fn evictable(&self) -> bool {
        false
    }

    /// The streamed groups its next forward will hold at once, less those on the device now: what the manager
    /// makes room for before it runs.
    fn window_bytes(&self) -> u64 {
        self.offload.window_bytes()
    }

    /// The groups the prefetch worker uploaded that no call borrows (recorded as `oom_retry:<model>`).
    fn release_idle(&mut self) -> u64 {
        self.offload.release_idle_prefetches()
    }

    fn class_name(&self) -> String {
        format!("GroupOffload<{}>", self.offload.config().model)
    }
}
