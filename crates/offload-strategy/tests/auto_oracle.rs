//! `Auto` and `KeepTogether` against a literal replay of the anchor's `AutoOffloadStrategy.__call__`.

use offload_strategy::{
    Auto, ComponentView, KeepTogether, MemoryReading, OffloadStrategy, OffloadView, ResidentComponent,
    smallest_sufficient,
};
use proptest::prelude::*;

/// The anchor's strategy, line for line, on the hooks it is given (the candidates, in registration order).
/// Python integers are unbounded and signed; `i128` stands in for them.
fn anchor(
    hooks: &[(String, u64)],
    current_module_size: u64,
    available_memory: u64,
    memory_reserve: u64,
) -> Vec<String> {
    if hooks.is_empty() {
        return Vec::new();
    }
    let current_module_size = i128::from(current_module_size);
    let resident_size: i128 = hooks.iter().map(|(_, size)| i128::from(*size)).sum();
    let headroom = i128::from(available_memory) - i128::from(memory_reserve);
    if current_module_size <= headroom {
        return Vec::new();
    }
    let min_memory_offload = current_module_size - headroom;
    if min_memory_offload >= resident_size {
        return hooks.iter().map(|(id, _)| id.clone()).collect();
    }

    // `sorted(module_sizes.items(), key=lambda x: x[1], reverse=True)`: Python's sort is stable under `reverse`.
    let mut module_sizes: Vec<(String, i128)> =
        hooks.iter().map(|(id, size)| (id.clone(), i128::from(*size))).collect();
    module_sizes.sort_by_key(|&(_, size)| std::cmp::Reverse(size));

    let n = module_sizes.len();
    let mut best: Option<(Vec<usize>, i128)> = None;
    for r in 1..=n {
        for combo in Combinations::new(n, r) {
            let size: i128 = combo.iter().map(|&i| module_sizes[i].1).sum();
            if size < min_memory_offload {
                continue;
            }
            if best.as_ref().is_none_or(|(_, best_size)| size < *best_size) {
                best = Some((combo, size));
            }
        }
    }
    let best: Vec<&str> =
        best.map(|(combo, _)| combo.iter().map(|&i| module_sizes[i].0.as_str()).collect()).unwrap_or_default();
    hooks.iter().filter(|(id, _)| best.contains(&id.as_str())).map(|(id, _)| id.clone()).collect()
}

/// `itertools.combinations(range(n), r)`: index tuples in lexicographic order.
struct Combinations {
    n: usize,
    next: Option<Vec<usize>>,
}

impl Combinations {
    fn new(n: usize, r: usize) -> Self {
        Self { n, next: (r <= n).then(|| (0..r).collect()) }
    }
}

impl Iterator for Combinations {
    type Item = Vec<usize>;

    fn next(&mut self) -> Option<Vec<usize>> {
        let current = self.next.take()?;
        let r = current.len();
        let mut following = current.clone();
        // The rightmost index that can still move right, as in the itertools recipe.
        if let Some(i) = (0..r).rev().find(|&i| following[i] != i + self.n - r) {
            following[i] += 1;
            for j in i + 1..r {
                following[j] = following[j - 1] + 1;
            }
            self.next = Some(following);
        }
        Some(current)
    }
}

#[test]
fn combinations_follow_itertools() {
    let all: Vec<Vec<usize>> = Combinations::new(4, 2).collect();
    assert_eq!(all, [[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]]);
    assert_eq!(Combinations::new(3, 3).count(), 1);
    assert_eq!(Combinations::new(2, 3).count(), 0);
}

/// One random decision: residents as `(bytes, grouped, in_use)`, then incoming, available and reserve.
#[derive(Debug, Clone)]
struct Case {
    resident: Vec<(u64, bool, bool)>,
    incoming: u64,
    available: u64,
    reserve: u64,
}

/// Sizes drawn from `0..=max` (small maxima force ties), scaled by `unit`, with memory in the same range so that
/// every branch of the rule is exercised.
fn cases() -> impl Strategy<Value = Case> {
    let shape = prop_oneof![
        (Just(1u64), 1u64..=4),
        (Just(1u64), 1u64..=12),
        (Just(1024u64), 1u64..=64),
        (Just(1u64 << 20), 1u64..=4096),
    ];
    (shape, 0usize..=12).prop_flat_map(|((unit, max), n)| {
        let flag = prop::bool::weighted(0.15);
        let resident = prop::collection::vec((0..=max, flag, flag), n);
        let total = max * (n as u64 + 1);
        (resident, 0..=total, 0..=total, 0..=max).prop_map(move |(resident, incoming, available, reserve)| Case {
            resident: resident.into_iter().map(|(b, g, u)| (b * unit, g, u)).collect(),
            incoming: incoming * unit,
            available: available * unit,
            reserve: reserve * unit,
        })
    })
}

fn residents(case: &Case) -> Vec<ResidentComponent> {
    case.resident
        .iter()
        .enumerate()
        .map(|(i, &(bytes, grouped, in_use))| {
            // Names repeat so that KeepTogether's sets match more than one component.
            let mut r = ResidentComponent::new(format!("c{i}"), format!("n{}", i % 4), bytes);
            r.evictable = !grouped;
            r.in_use = in_use;
            r
        })
        .collect()
}

fn view<'a>(case: &Case, incoming: &'a ComponentView, resident: &'a [ResidentComponent]) -> OffloadView<'a> {
    OffloadView {
        incoming,
        resident,
        reading: MemoryReading { available: case.available, total: u64::MAX, peak: 0 },
        reserve: case.reserve,
        device: "cuda:0",
        use_index: 1,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(6000))]

    #[test]
    fn auto_is_the_anchor(case in cases()) {
        let resident = residents(&case);
        let incoming = ComponentView::new("incoming", "incoming", case.incoming);
        let hooks: Vec<(String, u64)> =
            resident.iter().filter(|r| r.is_candidate()).map(|r| (r.id().to_string(), r.bytes())).collect();
        let expected = anchor(&hooks, case.incoming, case.available, case.reserve);
        prop_assert_eq!(Auto.decide(&view(&case, &incoming, &resident)), expected);
    }

    #[test]
    fn keep_together_is_the_anchor_without_the_partners(case in cases()) {
        let resident = residents(&case);
        // The incoming component is named `n1`, kept with `n2`.
        let incoming = ComponentView::new("incoming", "n1", case.incoming);
        let strategy = KeepTogether::new([["n1", "n2"]]);
        let hooks: Vec<(String, u64)> = resident
            .iter()
            .filter(|r| r.is_candidate() && r.component.name != "n1" && r.component.name != "n2")
            .map(|r| (r.id().to_string(), r.bytes()))
            .collect();
        let expected = anchor(&hooks, case.incoming, case.available, case.reserve);
        prop_assert_eq!(strategy.decide(&view(&case, &incoming, &resident)), expected);
    }

    #[test]
    fn smallest_sufficient_is_the_anchors_search(
        sizes in prop::collection::vec(0u64..=6, 0..=12),
        need in 1u64..=40,
    ) {
        let hooks: Vec<(String, u64)> = sizes.iter().enumerate().map(|(i, &s)| (i.to_string(), s)).collect();
        // `available - reserve = -need` puts the anchor straight at its search with `need` to free.
        let expected: Vec<usize> =
            anchor(&hooks, 0, 0, need).iter().map(|id| id.parse().expect("index")).collect();
        prop_assert_eq!(smallest_sufficient(&sizes, need), expected);
    }
}
