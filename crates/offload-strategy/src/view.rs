//! The plain-data view a strategy decides on: the incoming component, the resident set, the reading.

use bytesize::ByteSize;

/// One component as a strategy sees it: an id that is unique in its manager, a human name and its size.
///
/// `bytes` is what the component holds on the execution device when resident. For a component under group
/// offload it is that component's resident budget, not its full weight size.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ComponentView {
    /// The manager's id for the component, e.g. `transformer_2`.
    pub id: String,
    /// The name the component was added under, e.g. `transformer`.
    pub name: String,
    /// Bytes the component occupies on the execution device.
    pub bytes: u64,
}

impl ComponentView {
    /// A view of a component with the given id, name and size.
    pub fn new(id: impl Into<String>, name: impl Into<String>, bytes: u64) -> Self {
        Self { id: id.into(), name: name.into(), bytes }
    }
}

/// A component that is resident on the execution device, with the flags that decide whether it may be chosen.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ResidentComponent {
    /// Who it is and how large it is.
    pub component: ComponentView,
    /// Whether the strategy may offload it wholesale: false for a component that streams its own groups
    /// (group offload) and is never released whole.
    pub evictable: bool,
    /// Another thread is running the component right now: it cannot be moved until that run ends.
    pub in_use: bool,
    /// The [`use_index`](OffloadView::use_index) of the component's most recent run, 0 if it never ran since
    /// auto offload was enabled. Recency-based strategies (LRU) read it.
    pub last_use: u64,
}

impl ResidentComponent {
    /// A resident component that may be chosen (not group-offloaded, not in use).
    pub fn new(id: impl Into<String>, name: impl Into<String>, bytes: u64) -> Self {
        Self { component: ComponentView::new(id, name, bytes), evictable: true, in_use: false, last_use: 0 }
    }

    /// The same component with its most recent use set.
    pub fn used_at(mut self, use_index: u64) -> Self {
        self.last_use = use_index;
        self
    }

    /// Whether a strategy may return this component: neither under group offload nor in use.
    pub fn is_candidate(&self) -> bool {
        self.evictable && !self.in_use
    }

    /// The component's id.
    pub fn id(&self) -> &str {
        &self.component.id
    }

    /// The component's size on the device.
    pub fn bytes(&self) -> u64 {
        self.component.bytes
    }
}

/// A memory reading of the execution device, taken just before the decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct MemoryReading {
    /// Bytes the device can still give: free memory plus the allocator's reusable cache.
    pub available: u64,
    /// The device's capacity in bytes.
    pub total: u64,
    /// The most bytes allocated at any time so far (non-decreasing).
    pub peak: u64,
}

/// Everything a strategy may look at to decide which resident components to offload.
///
/// The manager builds a view each time a component that is not resident is about to run on the execution device,
/// and each time a resident component that streams its layers (group offload) is about to run with a window (the
/// groups its call will bring onto the device at once) that does not fit beside the reserve: then `incoming`'s
/// bytes are that window. `resident` lists the other components resident on that device, in registration order.
#[derive(Debug, Clone, Copy)]
pub struct OffloadView<'a> {
    /// The component about to be onloaded.
    pub incoming: &'a ComponentView,
    /// The other components resident on the execution device, in registration order.
    pub resident: &'a [ResidentComponent],
    /// The reading of the execution device just before the decision.
    pub reading: MemoryReading,
    /// Headroom kept free for activations, in bytes.
    pub reserve: u64,
    /// The normalised execution device, e.g. `cuda:0`.
    pub device: &'a str,
    /// How many component runs the manager has started since auto offload was enabled, this one included
    /// (1 for the first run). Strategies that replay a captured sequence of uses (`Lookahead`) locate themselves
    /// with it; the others ignore it.
    pub use_index: u64,
}

impl OffloadView<'_> {
    /// Bytes that must be freed for the incoming component to fit with the reserve kept free; 0 when it fits.
    ///
    /// This is the anchor's `current_module_size - (available_memory - memory_reserve)` in signed arithmetic,
    /// saturated at zero: when the reserve exceeds what is available, the missing part of the reserve must be
    /// freed too (`bytes + reserve - available`).
    pub fn shortfall(&self) -> u64 {
        let wanted = u128::from(self.incoming.bytes) + u128::from(self.reserve);
        let missing = wanted.saturating_sub(u128::from(self.reading.available));
        u64::try_from(missing).unwrap_or(u64::MAX)
    }

    /// Whether the incoming component fits as things are: `bytes <= available - reserve`, compared as the anchor
    /// does in signed arithmetic.
    ///
    /// When the reserve exceeds what is available nothing fits, not even a component of zero bytes. It fits
    /// exactly when [`shortfall`](Self::shortfall) is 0.
    pub fn fits(&self) -> bool {
        u128::from(self.incoming.bytes) + u128::from(self.reserve) <= u128::from(self.reading.available)
    }

    /// The resident components a strategy may choose, in registration order.
    pub fn candidates(&self) -> impl Iterator<Item = &ResidentComponent> + '_ {
        self.resident.iter().filter(|r| r.is_candidate())
    }

    /// A one-line description of the decision's inputs, for logs.
    pub fn describe(&self) -> String {
        format!(
            "{} ({}) on {}: {} available, {} reserved, {} resident",
            self.incoming.id,
            ByteSize::b(self.incoming.bytes),
            self.device,
            ByteSize::b(self.reading.available),
            ByteSize::b(self.reserve),
            self.resident.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view<'a>(incoming: &'a ComponentView, available: u64, reserve: u64) -> OffloadView<'a> {
        OffloadView {
            incoming,
            resident: &[],
            reading: MemoryReading { available, total: u64::MAX, peak: 0 },
            reserve,
            device: "cuda:0",
            use_index: 1,
        }
    }

    #[test]
    fn shortfall_is_the_anchors_signed_arithmetic() {
        let six = ComponentView::new("x", "x", 6);
        // A component of 6 bytes: (available, reserve) -> shortfall; it fits exactly when that is 0.
        for (available, reserve, shortfall) in [(4, 1, 3), (7, 1, 0), (8, 1, 0), (6, 0, 0), (1, 3, 8), (0, 0, 6)] {
            let v = view(&six, available, reserve);
            assert_eq!(
                (v.shortfall(), v.fits()),
                (shortfall, shortfall == 0),
                "available {available} reserve {reserve}"
            );
        }
        let empty = ComponentView::new("x", "x", 0);
        assert_eq!((view(&empty, 1, 3).shortfall(), view(&empty, 1, 3).fits()), (2, false));
        assert_eq!((view(&empty, 3, 3).shortfall(), view(&empty, 3, 3).fits()), (0, true));
        let huge = ComponentView::new("x", "x", u64::MAX);
        assert_eq!((view(&huge, 0, u64::MAX).shortfall(), view(&huge, 0, u64::MAX).fits()), (u64::MAX, false));
    }
}
