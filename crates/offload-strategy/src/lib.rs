//! Offload policy: which resident components to move off the device so an incoming one fits.
//!
//! This crate is pure policy. A strategy is a function of an [`OffloadView`] (the incoming component, the
//! resident set, a memory reading, the reserve) and returns the ids of the resident components to offload. It
//! knows nothing about burn, devices, threads or clocks, and it never moves memory: the manager in
//! `offload-core` asks, acts, and records. A researcher's own strategy crate depends on this crate alone.
//!
//! # The built-in strategies
//!
//! | Strategy | Offloads, when the incoming component does not fit |
//! | --- | --- |
//! | [`Auto`] | the smallest-total set of candidates that frees enough (the anchor's rule, exact) |
//! | [`Sequential`] | every candidate, even when it fits (model CPU offload) |
//! | [`KeepTogether`] | as [`Auto`], but never a component co-scheduled with the incoming one |
//! | [`Lookahead`] | the candidates used furthest in the future, from a captured sequence of uses |
//! | [`Staged`] | every candidate but the ones a phase-staged plan keeps resident, even when it fits |
//!
//! [`smallest_sufficient`] exposes the search behind [`Auto`] on plain sizes, for strategies of one's own.
//!
//! # The contract
//!
//! - The manager calls [`OffloadStrategy::decide`] each time a component that is not resident is about to run
//!   on the execution device, with the other resident components in registration order.
//! - The strategy returns ids taken from `view.resident`. The manager offloads them in the order the resident set
//!   lists them, records each move, then onloads the incoming component.
//! - A strategy must never return a component for which [`ResidentComponent::is_candidate`] is false (under group
//!   offload, or running on another thread). The manager refuses such a decision with a typed error and moves
//!   nothing.
//! - Returning nothing when memory is short is allowed: the onload may then fail with out-of-memory, and the
//!   manager's OOM retry takes over.
//!
//! ```
//! use offload_strategy::{Auto, ComponentView, MemoryReading, OffloadStrategy, OffloadView, ResidentComponent};
//!
//! let incoming = ComponentView::new("transformer_2", "transformer", 11 << 30);
//! let resident = [ResidentComponent::new("text_encoder_1", "text_encoder", 7 << 30)];
//! let view = OffloadView {
//!     incoming: &incoming,
//!     resident: &resident,
//!     reading: MemoryReading { available: 12 << 30, total: 24 << 30, peak: 8 << 30 },
//!     reserve: 3_000_000_000,
//!     device: "cuda:0",
//!     use_index: 2,
//! };
//! assert_eq!(Auto.decide(&view), vec!["text_encoder_1".to_string()]);
//!
//! // Any closure of the right shape is a strategy too.
//! let offload_everything = |view: &OffloadView<'_>| {
//!     view.candidates().map(|r| r.id().to_string()).collect::<Vec<_>>()
//! };
//! assert_eq!(offload_everything.decide(&view).len(), 1);
//! ```

#![forbid(unsafe_code)]

pub mod auto;
mod keep_together;
mod lookahead;
mod sequential;
mod staged;
mod view;

pub use auto::{Auto, MEET_IN_THE_MIDDLE_MAX, smallest_sufficient};
pub use keep_together::KeepTogether;
pub use lookahead::Lookahead;
pub use sequential::Sequential;
pub use staged::Staged;
pub use view::{ComponentView, MemoryReading, OffloadView, ResidentComponent};

/// Decides which resident components to offload so that an incoming component fits on the execution device.
///
/// Implementations are pure functions of the view: no I/O, no clocks, no device access. The trait is object
/// safe; the manager holds strategies as `Arc<dyn OffloadStrategy>`. See the crate documentation for the full
/// contract.
pub trait OffloadStrategy: Send + Sync {
    /// Returns the ids of the resident components to offload before the incoming component is onloaded.
    fn decide(&self, view: &OffloadView<'_>) -> Vec<String>;

    /// A short name for logs and reports.
    fn name(&self) -> &str {
        "custom"
    }
}

impl<F> OffloadStrategy for F
where
    F: Fn(&OffloadView<'_>) -> Vec<String> + Send + Sync,
{
    fn decide(&self, view: &OffloadView<'_>) -> Vec<String> {
        self(view)
    }

    fn name(&self) -> &str {
        "closure"
    }
}
