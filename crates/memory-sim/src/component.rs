//! Virtual components: byte sizes, activation profiles and FLOPs, moving and running on a simulated card.

use std::sync::Arc;

use offload_core::{ComponentError, DeviceLedger, DeviceName, Direction, Offloadable};

use crate::card::SimCard;

/// What a component holds on the card while and after it runs, beyond its weights.
///
/// A call's activations are a sequence of allocations, not one. By default they are
/// [`allocations`](Self::allocations) equal parts of the working set, made one after the other and all held until
/// the call ends (a forward whose activations build up layer after layer to its peak). A working set that rises
/// and falls (a decoder whose early maps are freed before its largest are made) is given by its
/// [`levels`](Self::levels) instead ([`ActivationProfile::through_levels`]). On a full hard card the allocation
/// that crosses the card fails part-way through the call, and what the call holds at that moment stays held until
/// the manager has handled the error, as a failed torch forward's tensors stay alive while its out-of-memory
/// exception is handled: the readings of an `oom_retry` row show them (a peak above the weights, less available
/// than the weights alone leave).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActivationProfile {
    /// Bytes held at the peak of a call, above the weights and everything held at entry (activations).
    pub working: u64,
    /// Bytes the call leaves behind (its outputs: embeddings, latents), held until the component's next call,
    /// which consumes them.
    pub left_behind: u64,
    /// How many allocations the working set is made in (at least 1); with no levels, the last part takes the
    /// remainder.
    pub allocations: u32,
    /// The working set the call holds after each of its allocations and frees, in order: a rise is an
    /// allocation of the difference, a fall a free. Empty for [`allocations`](Self::allocations) equal parts.
    /// Any sequence is a valid call: a level is what is held, so nothing can be freed that was not made.
    pub levels: Vec<u64>,
}

impl Default for ActivationProfile {
    fn default() -> Self {
        Self { working: 0, left_behind: 0, allocations: 1, levels: Vec::new() }
    }
}

/// One change a call makes to what it holds on the card ([`ActivationProfile::steps`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Allocates these bytes.
    Allocate(u64),
    /// Frees these bytes, made earlier in the same call.
    Free(u64),
}

impl ActivationProfile {
    /// A working set made in one allocation, leaving `left_behind` bytes.
    pub fn new(working: u64, left_behind: u64) -> Self {
        Self { working, left_behind, ..Self::default() }
    }

    /// The same profile with the working set made in `allocations` parts (at least 1), all held until the call
    /// ends; any levels are dropped.
    pub fn in_allocations(self, allocations: u32) -> Self {
        Self { allocations: allocations.max(1), levels: Vec::new(), ..self }
    }

    /// A working set that rises and falls: `levels` are what the call holds after each allocation or free, in
    /// order (a level equal to the one before is no step). The working set is their highest, and the allocations
    /// are their rises.
    ///
    /// ```
    /// use memory_sim::{ActivationProfile, Step};
    ///
    /// let profile = ActivationProfile::through_levels(vec![4, 9, 4, 12], 1);
    /// assert_eq!(profile.working, 12);
    /// assert_eq!(profile.allocations, 3);
    /// let steps: Vec<Step> = profile.steps().collect();
    /// assert_eq!(steps, [Step::Allocate(4), Step::Allocate(5), Step::Free(5), Step::Allocate(8)]);
    /// ```
    pub fn through_levels(levels: Vec<u64>, left_behind: u64) -> Self {
        let working = levels.iter().copied().max().unwrap_or(0);
        let mut profile = Self { working, left_behind, allocations: 1, levels };
        profile.allocations = u32::try_from(profile.parts().count()).unwrap_or(u32::MAX).max(1);
        profile
    }

    /// The sizes of the working set's allocations, in the order they are made; with no levels they sum to the
    /// working set.
    pub fn parts(&self) -> impl Iterator<Item = u64> + '_ {
        self.steps().filter_map(|step| match step {
            Step::Allocate(bytes) => Some(bytes),
            Step::Free(_) => None,
        })
    }

    /// The call's allocations and frees, in order, up to its last level (the call then frees what it holds).
    pub fn steps(&self) -> Box<dyn Iterator<Item = Step> + '_> {
        if self.levels.is_empty() {
            let count = u64::from(self.allocations.max(1));
            let (part, rest) = (self.working / count, self.working % count);
            return Box::new((0..count).map(move |i| Step::Allocate(if i + 1 == count { part + rest } else { part })));
        }
        let steps = self.levels.iter().scan(0u64, |held, &level| {
            let before = std::mem::replace(held, level);
            Some(match level.cmp(&before) {
                std::cmp::Ordering::Greater => Some(Step::Allocate(level - before)),
                std::cmp::Ordering::Less => Some(Step::Free(before - level)),
                std::cmp::Ordering::Equal => None,
            })
        });
        Box::new(steps.flatten())
    }
}

/// The description of a virtual component: name, size, activations and work per call.
#[derive(Debug, Clone, PartialEq)]
pub struct ComponentProfile {
    /// The name it is added to the manager under.
    pub name: String,
    /// Weight bytes.
    pub bytes: u64,
    /// Activation profile of one call.
    pub activations: ActivationProfile,
    /// FLOPs of one call.
    pub flops: f64,
}

/// A component that exists only as numbers, moving and running on a [`SimCard`] through the real manager.
///
/// Onload allocates its bytes and pays the link; offload pays the link back and frees them; a call makes its
/// working set step by step (which can fail with out-of-memory in hard mode), pays compute time, frees it, and
/// leaves its outputs behind. A failed onload leaves it on the host with nothing allocated; a call that fails
/// part-way holds what it held at the failure until [`release_failed_call`](Offloadable::release_failed_call) (or
/// its next call).
#[derive(Debug)]
pub struct VirtualComponent {
    profile: ComponentProfile,
    card: Arc<SimCard>,
    device: DeviceName,
    held_outputs: u64,
    /// What a call that failed part-way held when it failed, still held.
    failed_call: u64,
    calls: u64,
}

impl VirtualComponent {
    /// A virtual component on the host.
    pub fn new(profile: ComponentProfile, card: Arc<SimCard>) -> Self {
        Self { profile, card, device: DeviceName::cpu(), held_outputs: 0, failed_call: 0, calls: 0 }
    }

    /// The profile it was built from.
    pub fn profile(&self) -> &ComponentProfile {
        &self.profile
    }

    /// How many calls completed.
    pub fn calls(&self) -> u64 {
        self.calls
    }

    /// Bytes a call that failed part-way still holds (0 once released).
    pub fn failed_call_bytes(&self) -> u64 {
        self.failed_call
    }

    /// One call: make the working set step by step, compute, free it, replace the held outputs. Returns the
    /// call's ordinal, a stand-in for its output. An allocation that fails leaves what the call held at that
    /// moment held (see [`failed_call_bytes`](Self::failed_call_bytes)).
    pub fn call(&mut self) -> Result<u64, ComponentError> {
        if self.device.is_cpu() {
            return Err(ComponentError::other(format!(
                "{} was called on the host; run it through the manager so it is onloaded first",
                self.profile.name
            )));
        }
        self.release_failed_call();
        // The previous call's outputs are this call's inputs: consumed here.
        self.card.free(self.held_outputs);
        self.held_outputs = 0;
        let left_behind = self.profile.activations.left_behind;
        let mut held = 0;
        for step in self.profile.activations.steps() {
            match step {
                Step::Allocate(bytes) => {
                    if let Err(error) = self.card.allocate(bytes) {
                        self.failed_call = held;
                        return Err(error);
                    }
                    held += bytes;
                }
                Step::Free(bytes) => {
                    self.card.free(bytes);
                    held -= bytes;
                }
            }
        }
        self.card.compute(self.profile.flops);
        self.card.free(held);
        self.card.allocate(left_behind)?;
        self.held_outputs = left_behind;
        self.calls += 1;
        Ok(self.calls)
    }
}

impl Offloadable for VirtualComponent {
    fn bytes(&self) -> u64 {
        self.profile.bytes
    }

    fn device(&self) -> DeviceName {
        self.device.clone()
    }

    fn onload(&mut self, device: &DeviceName) -> Result<(), ComponentError> {
        self.card.allocate(self.profile.bytes)?;
        if let Err(error) = self.card.transfer(self.profile.bytes, Direction::HostToDevice) {
            self.card.free(self.profile.bytes);
            return Err(error);
        }
        self.device = device.clone();
        Ok(())
    }

    fn offload(&mut self) -> Result<(), ComponentError> {
        // Like `module.to("cpu")` in the anchor, an offload copies the weights back across the link.
        self.card.transfer(self.profile.bytes, Direction::DeviceToHost)?;
        self.card.free(self.profile.bytes);
        self.device = DeviceName::cpu();
        Ok(())
    }

    fn release_failed_call(&mut self) {
        self.card.free(self.failed_call);
        self.failed_call = 0;
    }

    fn class_name(&self) -> String {
        format!("Virtual<{}>", self.profile.name)
    }
}
