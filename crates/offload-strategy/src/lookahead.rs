//! [`Lookahead`]: replay a captured sequence of uses and offload what is needed furthest in the future.

use std::cmp::Reverse;
use std::collections::HashMap;

use crate::{OffloadStrategy, OffloadView, ResidentComponent};

/// Offloads the candidates whose next use is furthest away, knowing the order in which components will run.
///
/// It is built from a sequence of uses captured on an earlier run of the same pipeline: the *names* of the
/// components in the order they ran, one entry per run (names, not ids, because ids change between runs). The
/// view's [`use_index`](OffloadView::use_index) places the decision in that sequence: the current run is
/// `uses[use_index - 1]` and the future is `uses[use_index..]`.
///
/// The rule, Belady's eviction rule adapted to components of different sizes:
///
/// 1. With no candidates, or when the incoming component fits, offload nothing.
/// 2. Otherwise order the candidates by their next use: those never used again first, then the furthest next use
///    first; between equal next uses the larger first, then the earlier registered.
/// 3. Take candidates in that order until their total covers the [shortfall](OffloadView::shortfall). If even all of
///    them do not cover it, all of them are offloaded.
/// 4. Then give back what became unnecessary: from the soonest-needed choice back, a chosen component stays on the
///    device when the others still cover the shortfall (a small component needed far ahead is not evicted beside
///    a large one that alone frees enough).
///
/// The chosen components are returned in registration order. Components that share a name share their next use.
/// When the run departs from the captured sequence the decisions stay valid (only candidates are returned) but
/// are no longer informed; nothing checks for it.
///
/// ```
/// use offload_strategy::{ComponentView, Lookahead, MemoryReading, OffloadStrategy, OffloadView, ResidentComponent};
///
/// // Encode, then denoise, then decode; then the next prompt.
/// let lookahead = Lookahead::new(["text_encoder", "transformer", "vae", "text_encoder", "transformer", "vae"]);
/// let incoming = ComponentView::new("vae_1", "vae", 1 << 30);
/// let resident = [
///     ResidentComponent::new("text_encoder_1", "text_encoder", 2 << 30),
///     ResidentComponent::new("transformer_1", "transformer", 6 << 30),
/// ];
/// let view = OffloadView {
///     incoming: &incoming,
///     resident: &resident,
///     reading: MemoryReading { available: 0, total: 8 << 30, peak: 8 << 30 },
///     reserve: 0,
///     device: "cuda:0",
///     use_index: 3,
/// };
/// // The text encoder runs next (use 4), the transformer after it (use 5): the transformer goes.
/// assert_eq!(lookahead.next_use("text_encoder", 3), Some(4));
/// assert_eq!(lookahead.decide(&view), ["transformer_1"]);
/// ```
#[derive(Debug, Clone, Default)]
pub struct Lookahead {
    uses: Vec<String>,
    /// For each name, the 0-based positions of its uses in increasing order.
    positions: HashMap<String, Vec<usize>>,
}

impl Lookahead {
    /// A strategy replaying the given sequence of uses, one component name per run.
    pub fn new(uses: impl IntoIterator<Item = impl Into<String>>) -> Self {
        let uses: Vec<String> = uses.into_iter().map(Into::into).collect();
        let mut positions: HashMap<String, Vec<usize>> = HashMap::new();
        for (p, name) in uses.iter().enumerate() {
            positions.entry(name.clone()).or_default().push(p);
        }
        Self { uses, positions }
    }

    /// The captured sequence of uses.
    pub fn uses(&self) -> &[String] {
        &self.uses
    }

    /// The use index (1-based, like [`OffloadView::use_index`]) of the first use of `name` after use `use_index`,
    /// or `None` when it is not used again.
    pub fn next_use(&self, name: &str, use_index: u64) -> Option<u64> {
        let positions = self.positions.get(name)?;
        // Use `use_index` sits at position `use_index - 1`; the uses after it start at position `use_index`.
        let after = usize::try_from(use_index).unwrap_or(usize::MAX);
        let p = positions[positions.partition_point(|&p| p < after)..].first()?;
        u64::try_from(*p + 1).ok()
    }
}

impl OffloadStrategy for Lookahead {
    fn decide(&self, view: &OffloadView<'_>) -> Vec<String> {
        let candidates: Vec<&ResidentComponent> = view.candidates().collect();
        if candidates.is_empty() || view.fits() {
            return Vec::new();
        }
        let need = u128::from(view.shortfall());
        let mut order: Vec<(usize, Option<u64>)> =
            candidates.iter().enumerate().map(|(i, r)| (i, self.next_use(&r.component.name, view.use_index))).collect();
        // Never used again ranks as the furthest; `sort_by_key` is stable, so registration order breaks the last tie.
        order.sort_by_key(|&(i, next)| (Reverse(next.unwrap_or(u64::MAX)), Reverse(candidates[i].bytes())));

        let mut freed = 0u128;
        let mut chosen: Vec<usize> = Vec::with_capacity(order.len());
        for &(i, _) in &order {
            if freed >= need {
                break;
            }
            freed += u128::from(candidates[i].bytes());
            chosen.push(i);
        }
        // Give back what the later, larger choices made unnecessary: walking from the soonest-needed victim
        // back, keep a component on the device whenever the others still cover the shortfall. Without this, a
        // small component needed far ahead is evicted alongside the large one that alone frees enough.
        for position in (0..chosen.len()).rev() {
            let bytes = u128::from(candidates[chosen[position]].bytes());
            if freed - bytes >= need && chosen.len() > 1 {
                freed -= bytes;
                chosen.remove(position);
            }
        }
        chosen.sort_unstable();
        chosen.into_iter().map(|i| candidates[i].id().to_string()).collect()
    }

    fn name(&self) -> &str {
        "lookahead"
    }
}

#[cfg(test)]
mod tests {
    use expect_test::{Expect, expect};

    use super::*;
    use crate::{ComponentView, MemoryReading};

    /// Renders the decision at `use_index` for `incoming` (`name:units`) with `free` units available and no
    /// reserve. Residents are `name:units` (ids are the names), with a `!g` suffix for group-offloaded.
    fn check(lookahead: &Lookahead, use_index: u64, incoming: &str, free: u64, resident: &str, expect: Expect) {
        let parse = |spec: &str| {
            let (name, rest) = spec.split_once(':').expect("name:units");
            let (units, flags) = rest.split_once('!').unwrap_or((rest, ""));
            (name.to_string(), units.parse::<u64>().expect("units"), flags.contains('g'))
        };
        let (name, bytes, _) = parse(incoming);
        let incoming = ComponentView::new(name.clone(), name, bytes);
        let resident: Vec<ResidentComponent> = resident
            .split_whitespace()
            .map(|spec| {
                let (name, bytes, group) = parse(spec);
                let mut r = ResidentComponent::new(name.clone(), name, bytes);
                r.evictable = !group;
                r
            })
            .collect();
        let view = OffloadView {
            incoming: &incoming,
            resident: &resident,
            reading: MemoryReading { available: free, total: 100, peak: 0 },
            reserve: 0,
            device: "cuda:0",
            use_index,
        };
        expect.assert_eq(&format!("{:?}", lookahead.decide(&view)));
    }

    fn two_prompts() -> Lookahead {
        Lookahead::new(["te", "dit", "vae", "te", "dit", "vae"])
    }

    #[test]
    fn next_use_counts_from_the_use_after_the_current_one() {
        let lookahead = two_prompts();
        assert_eq!(lookahead.next_use("te", 1), Some(4));
        assert_eq!(lookahead.next_use("te", 3), Some(4));
        assert_eq!(lookahead.next_use("te", 4), None);
        assert_eq!(lookahead.next_use("vae", 5), Some(6));
        assert_eq!(lookahead.next_use("vae", 6), None);
        assert_eq!(lookahead.next_use("vae", 60), None);
        assert_eq!(lookahead.next_use("unet", 1), None);
        assert_eq!(lookahead.next_use("te", 0), Some(1));
    }

    #[test]
    fn nothing_when_it_fits() {
        check(&two_prompts(), 3, "vae:1", 1, "te:2 dit:6", expect![[r#"[]"#]]);
        check(&two_prompts(), 3, "vae:1", 0, "", expect![[r#"[]"#]]);
    }

    #[test]
    fn the_furthest_next_use_goes_first() {
        check(&two_prompts(), 3, "vae:1", 0, "te:2 dit:6", expect![[r#"["dit"]"#]]);
        check(&two_prompts(), 4, "te:1", 0, "dit:6 vae:1", expect![[r#"["vae"]"#]]);
    }

    #[test]
    fn takes_more_until_the_shortfall_is_covered() {
        check(&two_prompts(), 3, "vae:5", 0, "te:2 dit:4", expect![[r#"["te", "dit"]"#]]);
        // The vae, needed furthest, is taken first but is not enough; the dit alone covers it, so the vae stays.
        check(&two_prompts(), 4, "te:2", 0, "dit:6 vae:1", expect![[r#"["dit"]"#]]);
    }

    #[test]
    fn never_used_again_goes_first_larger_first() {
        // At the last use nothing is used again: the larger goes first.
        check(&two_prompts(), 6, "vae:1", 0, "te:2 dit:6", expect![[r#"["dit"]"#]]);
        check(&two_prompts(), 5, "dit:1", 0, "te:2 vae:6 unet:3", expect![[r#"["unet"]"#]]);
    }

    #[test]
    fn all_when_even_all_cannot_cover() {
        check(&two_prompts(), 3, "vae:20", 0, "te:2 dit:6", expect![[r#"["te", "dit"]"#]]);
    }

    #[test]
    fn an_unevictable_component_is_never_chosen() {
        check(&two_prompts(), 3, "vae:1", 0, "te:2 dit:6!g", expect![[r#"["te"]"#]]);
    }
}
