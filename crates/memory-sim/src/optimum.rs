//! The offline optimum: the fewest bytes any offloader could move for a recorded sequence of uses, a lower bound
//! for every run of that sequence under the same rules.
//!
//! # The model
//!
//! Components have sizes; a sequence of uses says which component runs when; a budget says how many weight
//! bytes may be resident during each use. A set of residents is allowed when it fits the budget of the use it
//! serves or holds a single component: a lone component always loads, as the anchor's rule lets it. Each onload
//! moves the component's bytes to the device and each offload moves them back (as `module.to("cpu")` and our
//! virtual components do), so the cost is onloaded plus offloaded bytes. Nothing is charged for the residents
//! left at the end.
//!
//! # The rules, and why the result is a bound
//!
//! The budget is what the card itself lets a run keep, never a strategy's choice (the reserve is the `auto`
//! strategy's margin, and another strategy may ignore it): while a component runs, its working set and the
//! outputs the other components hold are on the card beside the resident weights, so the weights can take at
//! most the card's usable memory less those ([`simulate`](crate::simulate) computes it per use). On a hard card
//! that is a rule the card enforces; on a soft card, which lets a run overcommit, the card's size is replaced by
//! the most the run itself allocated when that is more. Every resident set the run held at a completed use is
//! then allowed, and the run paid at least each onload and offload along its path, so no run under these rules
//! moves fewer bytes than the optimum: a figure printed as the optimum is a true lower bound for the run beside
//! it (tested over every card and strategy the integration runs).
//!
//! # The search
//!
//! An exact dynamic program over resident sets: after each use, the cheapest way to reach every set that holds
//! the used component. Offloads are only made when an onload needs the room, which loses nothing because an
//! offload costs the same whenever it happens. With equal sizes this agrees with Belady's rule (evict what is
//! needed furthest in the future); with unequal sizes the program is exact where Belady is not. Each use costs
//! O(3^n) for n components, so it is limited to [`MAX_COMPONENTS`], far above a pipeline's handful.

/// The most components [`optimal_moves`] searches exactly.
pub const MAX_COMPONENTS: usize = 12;

/// What the optimum moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Moves {
    /// Bytes moved host to device.
    pub onloaded: u64,
    /// Bytes moved device to host.
    pub offloaded: u64,
}

impl Moves {
    /// Bytes moved both ways.
    pub fn total(&self) -> u64 {
        self.onloaded + self.offloaded
    }
}

/// The fewest bytes moved to serve `uses` (indices into `sizes`) when at most `budget(at)` weight bytes may be
/// resident during use `at` (a position in `uses`), or `None` when there are more than [`MAX_COMPONENTS`]
/// components or a use names no component.
///
/// ```
/// use memory_sim::optimum::optimal_moves;
/// // Two 6-byte components alternating on a 10-byte budget: every use after the first swaps.
/// let moves = optimal_moves(&[6, 6], &[0, 1, 0, 1], |_| 10).unwrap();
/// assert_eq!((moves.onloaded, moves.offloaded), (24, 18));
/// ```
pub fn optimal_moves(sizes: &[u64], uses: &[usize], budget: impl Fn(usize) -> u64) -> Option<Moves> {
    let n = sizes.len();
    if n > MAX_COMPONENTS || uses.iter().any(|&u| u >= n) {
        return None;
    }
    let sets = 1usize << n;
    let total: Vec<u64> = (0..sets).map(|m| (0..n).filter(|i| m & (1 << i) != 0).map(|i| sizes[i]).sum()).collect();
    let allowed = |m: usize, at: usize| total[m] <= budget(at) || m.count_ones() <= 1;
    // For each resident set, the cheapest (cost, onloaded) to be there now.
    let mut best: Vec<Option<(u64, u64)>> = vec![None; sets];
    best[0] = Some((0, 0));
    for (at, &used) in uses.iter().enumerate() {
        let bit = 1usize << used;
        let mut next: Vec<Option<(u64, u64)>> = vec![None; sets];
        let offer = |slot: &mut Option<(u64, u64)>, candidate: (u64, u64)| {
            if slot.is_none_or(|current| candidate.0 < current.0) {
                *slot = Some(candidate);
            }
        };
        for (mask, state) in best.iter().enumerate() {
            let Some((cost, onloaded)) = *state else { continue };
            // The used component is resident (onloaded now if it was not); of the others keep any subset that
            // fits this use's budget beside it, and offload the rest. A resident used component is held to
            // the budget too: the set must fit while it runs.
            let onload = if mask & bit == 0 { sizes[used] } else { 0 };
            let others = mask & !bit;
            let mut keep = others;
            loop {
                let target = keep | bit;
                if allowed(target, at) {
                    let offloaded = total[others & !keep];
                    offer(&mut next[target], (cost + offloaded + onload, onloaded + onload));
                }
                if keep == 0 {
                    break;
                }
                keep = (keep - 1) & others;
            }
        }
        best = next;
    }
    best.iter()
        .flatten()
        .min_by_key(|(cost, _)| *cost)
        .map(|&(cost, onloaded)| Moves { onloaded, offloaded: cost - onloaded })
}

/// The budget of each use under the card's rules (see the [module docs](self)): `memory` (the card's usable
/// bytes, or in soft mode the most the run allocated where that is more) less the running component's
/// `working` set and the `left_behind` outputs the other components already called still hold. `uses`,
/// `working` and `left_behind` index components as in [`optimal_moves`].
///
/// ```
/// use memory_sim::optimum::use_budgets;
/// // Component 1 leaves 2 bytes behind; while 0 runs after it, they are on the card too.
/// assert_eq!(use_budgets(&[0, 1, 0], &[3, 1], &[0, 2], 10), [7, 9, 5]);
/// ```
pub fn use_budgets(uses: &[usize], working: &[u64], left_behind: &[u64], memory: u64) -> Vec<u64> {
    let mut called = vec![false; working.len()];
    uses.iter()
        .map(|&used| {
            let held: u64 = (0..working.len()).filter(|&j| j != used && called[j]).map(|j| left_behind[j]).sum();
            called[used] = true;
            memory.saturating_sub(working[used]).saturating_sub(held)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Belady's rule on equal sizes, by hand: capacity for two of three.
    #[test]
    fn agrees_with_belady_on_equal_sizes() {
        // Uses a b c a b: Belady keeps a and b when c arrives? At c, a is used next (index 3), b at 4: evict b.
        // Then a hits, b onloads evicting c (never used again). Onloads: a b c b = 4, offloads: b, c = 2.
        let moves = optimal_moves(&[1, 1, 1], &[0, 1, 2, 0, 1], |_| 2).unwrap();
        assert_eq!((moves.onloaded, moves.offloaded), (4, 2));
    }

    #[test]
    fn a_lone_component_larger_than_the_budget_still_loads() {
        let moves = optimal_moves(&[10, 3], &[0, 1, 0], |_| 5).unwrap();
        assert_eq!((moves.onloaded, moves.offloaded), (23, 13));
    }

    #[test]
    fn everything_fits_means_each_component_moves_once() {
        let moves = optimal_moves(&[4, 5, 6], &[0, 1, 1, 1, 2, 0, 1, 1, 2], |_| 100).unwrap();
        assert_eq!(moves, Moves { onloaded: 15, offloaded: 0 });
    }

    /// A component already resident is held to its use's budget too: a tighter use forces an offload.
    #[test]
    fn a_resident_set_must_fit_every_use_it_serves() {
        let budgets = [10, 10, 1];
        let moves = optimal_moves(&[5, 5], &[0, 1, 1], |at| budgets[at]).unwrap();
        assert_eq!(moves, Moves { onloaded: 10, offloaded: 5 });
    }

    #[test]
    fn refuses_what_it_cannot_search() {
        assert!(optimal_moves(&[1; MAX_COMPONENTS + 1], &[0], |_| 1).is_none());
        assert!(optimal_moves(&[1], &[3], |_| 1).is_none());
    }

    /// The program never does worse than keeping only the used component, and is exact against brute force
    /// over every eviction choice on small random cases.
    #[test]
    fn matches_an_exhaustive_search_on_small_cases() {
        fn brute(sizes: &[u64], uses: &[usize], budgets: &[u64], resident: usize, at: usize) -> u64 {
            if at == uses.len() {
                return 0;
            }
            let bit = 1usize << uses[at];
            let onload = if resident & bit == 0 { sizes[uses[at]] } else { 0 };
            let sum = |m: usize| (0..sizes.len()).filter(|i| m & (1 << i) != 0).map(|i| sizes[i]).sum::<u64>();
            let others = resident & !bit;
            let mut best = u64::MAX;
            // Every subset of the other residents, kept beside the used component or offloaded.
            for keep in 0..=others {
                if keep & !others != 0 {
                    continue;
                }
                let target = keep | bit;
                if sum(target) <= budgets[at] || target.count_ones() == 1 {
                    let cost = sum(others & !keep) + onload + brute(sizes, uses, budgets, target, at + 1);
                    best = best.min(cost);
                }
            }
            best
        }
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..300 {
            let n = 1 + (next() % 4) as usize;
            let sizes: Vec<u64> = (0..n).map(|_| 1 + next() % 6).collect();
            let uses: Vec<usize> = (0..(1 + next() % 7)).map(|_| (next() % n as u64) as usize).collect();
            let budgets: Vec<u64> = uses.iter().map(|_| next() % 14).collect();
            let moves = optimal_moves(&sizes, &uses, |at| budgets[at]).unwrap();
            assert_eq!(moves.total(), brute(&sizes, &uses, &budgets, 0, 0), "{sizes:?} {uses:?} {budgets:?}");
        }
    }
}
