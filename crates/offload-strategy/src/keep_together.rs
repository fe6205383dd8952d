//! [`KeepTogether`]: the anchor's rule, except that co-scheduled components never make room for each other.

use crate::auto::decide_among;
use crate::{OffloadStrategy, OffloadView, ResidentComponent};

/// Keeps co-scheduled components on the device together: [`Auto`](crate::Auto)'s rule, applied only to the
/// candidates that share no set with the incoming component.
///
/// Each set is a group of component *names* (the name a component was added under, [`ComponentView::name`]) that
/// run in alternation, such as the two denoisers of a two-stage model that swap every few steps. When the incoming
/// component belongs to one or more sets, no member of those sets is offloaded to make room for it; the other
/// candidates are chosen exactly as `Auto` chooses among all of them (nothing when it fits, else the
/// smallest-total subset that frees enough, else all of them). When the incoming component is in no set, this is
/// `Auto`.
///
/// When the protected members leave too little room, every other candidate is offloaded and the onload may then
/// run out of memory; the manager's OOM retry handles that as it does for any strategy. This is the memory-aware
/// form of the docs' `KeepDitsTogether` example, which offloads every non-DiT before a DiT runs and everything
/// before anything else.
///
/// [`ComponentView::name`]: crate::ComponentView::name
///
/// ```
/// use offload_strategy::{ComponentView, KeepTogether, MemoryReading, OffloadStrategy, OffloadView, ResidentComponent};
///
/// let strategy = KeepTogether::new([["transformer", "transformer_2"]]);
/// let incoming = ComponentView::new("transformer_2_1", "transformer_2", 14 << 30);
/// let resident = [
///     ResidentComponent::new("text_encoder_1", "text_encoder", 16 << 30),
///     ResidentComponent::new("transformer_1", "transformer", 14 << 30),
///     ResidentComponent::new("vae_1", "vae", 1 << 30),
/// ];
/// let view = OffloadView {
///     incoming: &incoming,
///     resident: &resident,
///     reading: MemoryReading { available: 4 << 30, total: 80 << 30, peak: 26 << 30 },
///     reserve: 0,
///     device: "cuda:0",
///     use_index: 30,
/// };
/// // 10 GiB must go. Auto takes the other transformer (14 GiB is the smallest sufficient total); KeepTogether
/// // keeps the pair on the device and takes the text encoder.
/// assert_eq!(offload_strategy::Auto.decide(&view), ["transformer_1"]);
/// assert_eq!(strategy.decide(&view), ["text_encoder_1"]);
/// ```
#[derive(Debug, Clone, Default)]
pub struct KeepTogether {
    sets: Vec<Vec<String>>,
}

impl KeepTogether {
    /// A strategy keeping each given set of component names together.
    pub fn new<S, N>(sets: impl IntoIterator<Item = S>) -> Self
    where
        S: IntoIterator<Item = N>,
        N: Into<String>,
    {
        Self { sets: sets.into_iter().map(|set| set.into_iter().map(Into::into).collect()).collect() }
    }

    /// The sets of component names kept together.
    pub fn sets(&self) -> &[Vec<String>] {
        &self.sets
    }

    /// Whether `resident` shares a set with the component named `incoming`, and so must stay.
    fn protects(&self, incoming: &str, resident: &ResidentComponent) -> bool {
        let name = resident.component.name.as_str();
        self.sets.iter().any(|set| set.iter().any(|n| n == incoming) && set.iter().any(|n| n == name))
    }
}

impl OffloadStrategy for KeepTogether {
    fn decide(&self, view: &OffloadView<'_>) -> Vec<String> {
        let incoming = view.incoming.name.as_str();
        let candidates: Vec<&ResidentComponent> = view.candidates().filter(|r| !self.protects(incoming, r)).collect();
        decide_among(view, &candidates)
    }

    fn name(&self) -> &str {
        "keep_together"
    }
}

#[cfg(test)]
mod tests {
    use expect_test::{Expect, expect};

    use super::*;
    use crate::{Auto, ComponentView, MemoryReading};

    /// Renders KeepTogether's and Auto's decisions for `incoming` (`name:units`) with `free` units available and
    /// no reserve. Residents are `name:units`; ids are the names.
    fn check(strategy: &KeepTogether, incoming: &str, free: u64, resident: &str, expect: Expect) {
        let parse = |spec: &str| {
            let (name, units) = spec.split_once(':').expect("name:units");
            (name.to_string(), units.parse::<u64>().expect("units"))
        };
        let (name, bytes) = parse(incoming);
        let incoming = ComponentView::new(name.clone(), name, bytes);
        let resident: Vec<ResidentComponent> = resident
            .split_whitespace()
            .map(|spec| {
                let (name, bytes) = parse(spec);
                ResidentComponent::new(name.clone(), name, bytes)
            })
            .collect();
        let view = OffloadView {
            incoming: &incoming,
            resident: &resident,
            reading: MemoryReading { available: free, total: 100, peak: 0 },
            reserve: 0,
            device: "cuda:0",
            use_index: 1,
        };
        let actual = format!("keep_together {:?}, auto {:?}", strategy.decide(&view), Auto.decide(&view));
        expect.assert_eq(&actual);
    }

    fn dits() -> KeepTogether {
        KeepTogether::new([["dit_high", "dit_low"]])
    }

    #[test]
    fn a_partner_is_never_offloaded_for_its_partner() {
        check(
            &dits(),
            "dit_low:10",
            2,
            "te:12 dit_high:10 vae:1",
            expect![[r#"keep_together ["te"], auto ["dit_high"]"#]],
        );
    }

    #[test]
    fn memory_aware_among_the_others() {
        check(
            &dits(),
            "dit_low:10",
            6,
            "te:9 dit_high:10 vae:1 pe:4",
            expect![[r#"keep_together ["pe"], auto ["pe"]"#]],
        );
        check(&dits(), "dit_low:10", 20, "te:9 dit_high:10 vae:1", expect![[r#"keep_together [], auto []"#]]);
    }

    #[test]
    fn not_enough_without_the_partner_offloads_all_others() {
        check(
            &dits(),
            "dit_low:10",
            0,
            "te:3 dit_high:10 vae:1",
            expect![[r#"keep_together ["te", "vae"], auto ["dit_high"]"#]],
        );
        check(&dits(), "dit_low:10", 0, "dit_high:10", expect![[r#"keep_together [], auto ["dit_high"]"#]]);
    }

    #[test]
    fn outside_every_set_it_is_auto() {
        check(&dits(), "vae:10", 2, "te:9 dit_high:10 dit_low:10", expect![[r#"keep_together ["te"], auto ["te"]"#]]);
    }

    #[test]
    fn sets_protect_only_their_own_members() {
        let strategy = KeepTogether::new(vec![vec!["dit_high", "dit_low"], vec!["te", "te_2"]]);
        check(
            &strategy,
            "te:9",
            0,
            "te_2:9 dit_high:10 dit_low:10",
            expect![[r#"keep_together ["dit_high"], auto ["te_2"]"#]],
        );
        check(
            &strategy,
            "dit_low:10",
            0,
            "te_2:9 dit_high:10",
            expect![[r#"keep_together ["te_2"], auto ["dit_high"]"#]],
        );
    }
}
