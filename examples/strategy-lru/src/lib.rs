//! A least-recently-used offload strategy, written the way a researcher would: in its own crate, against
//! `offload-strategy` alone.
//!
//! [`Lru`] offloads the candidates that were used longest ago until the shortfall is covered. Like every
//! strategy it is a pure function of the view: recency comes from each resident's
//! [`last_use`](ResidentComponent::last_use), which the manager keeps for it.

#![forbid(unsafe_code)]

use offload_strategy::{OffloadStrategy, OffloadView, ResidentComponent};

/// Offloads the least recently used candidates until the incoming component fits.
///
/// # The rule
///
/// 1. With no candidates, or when the incoming component fits, offload nothing.
/// 2. Otherwise take candidates from the least recently used on (ties in registration order) until their total
///    covers the [shortfall](OffloadView::shortfall); if even all of them do not cover it, all of them go.
///
/// The chosen components are returned in registration order.
///
/// ```
/// use offload_strategy::{ComponentView, MemoryReading, OffloadStrategy, OffloadView, ResidentComponent};
/// use strategy_lru::Lru;
///
/// let incoming = ComponentView::new("c", "c", 4);
/// // `a` last ran at use 1, `b` at use 2: `a` is the least recently used and goes.
/// let resident = [ResidentComponent::new("a", "a", 4).used_at(1), ResidentComponent::new("b", "b", 4).used_at(2)];
/// let reading = MemoryReading { available: 0, total: 8, peak: 0 };
/// let view = OffloadView { incoming: &incoming, resident: &resident, reading, reserve: 0, device: "cuda:0", use_index: 3 };
/// assert_eq!(Lru.decide(&view), ["a"]);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Lru;

impl OffloadStrategy for Lru {
    fn decide(&self, view: &OffloadView<'_>) -> Vec<String> {
        let mut order: Vec<&ResidentComponent> = view.candidates().collect();
        if order.is_empty() || view.fits() {
            return Vec::new();
        }
        // Stable: equal recency keeps registration order.
        order.sort_by_key(|r| r.last_use);

        let need = u128::from(view.shortfall());
        let mut freed = 0u128;
        let mut chosen: Vec<&str> = Vec::new();
        for r in order {
            if freed >= need {
                break;
            }
            freed += u128::from(r.bytes());
            chosen.push(r.id());
        }
        // Back to registration order, the order the resident set lists them.
        view.candidates().filter(|r| chosen.contains(&r.id())).map(|r| r.id().to_string()).collect()
    }

    fn name(&self) -> &str {
        "lru"
    }
}

#[cfg(test)]
mod tests {
    use offload_strategy::{ComponentView, MemoryReading};

    use super::*;

    /// One decision: `incoming` is `id:bytes`, each resident `id:bytes@last_use`, with a `!` suffix when in use.
    fn decide(incoming: &str, available: u64, resident: &str) -> Vec<String> {
        let (id, bytes) = incoming.split_once(':').expect("id:bytes");
        let incoming = ComponentView::new(id, id, bytes.parse().expect("bytes"));
        let resident: Vec<ResidentComponent> = resident
            .split_whitespace()
            .map(|spec| {
                let (spec, in_use) = spec.strip_suffix('!').map_or((spec, false), |s| (s, true));
                let (id, rest) = spec.split_once(':').expect("id:bytes@use");
                let (bytes, last_use) = rest.split_once('@').expect("bytes@use");
                let mut r = ResidentComponent::new(id, id, bytes.parse().expect("bytes"))
                    .used_at(last_use.parse().expect("use"));
                r.in_use = in_use;
                r
            })
            .collect();
        let reading = MemoryReading { available, total: 100, peak: 0 };
        Lru.decide(&OffloadView {
            incoming: &incoming,
            resident: &resident,
            reading,
            reserve: 0,
            device: "cuda:0",
            use_index: 9,
        })
    }

    #[test]
    fn evicts_the_least_recently_used() {
        assert_eq!(decide("vae:4", 2, "te:4@1 dit:4@2"), ["te"]);
        assert_eq!(decide("te:4", 2, "dit:4@5 vae:4@3"), ["vae"]);
        assert!(decide("te:4", 10, "dit:4@5 vae:4@3").is_empty(), "it fits");
    }

    #[test]
    fn takes_more_until_covered_and_all_when_not_enough() {
        assert_eq!(decide("d:5", 0, "a:1@1 b:5@2 c:3@3"), ["a", "b"]);
        assert_eq!(decide("e:50", 0, "a:1@1 b:5@2 c:3@3"), ["a", "b", "c"]);
    }

    #[test]
    fn equal_recency_keeps_registration_order_and_in_use_stays() {
        assert_eq!(decide("x:2", 0, "a:2@0 b:2@0"), ["a"]);
        assert_eq!(decide("x:2", 0, "a:2@0! b:2@4"), ["b"]);
        assert!(decide("x:2", 0, "a:2@1! b:2@2!").is_empty());
        assert_eq!(Lru.name(), "lru");
    }
}
