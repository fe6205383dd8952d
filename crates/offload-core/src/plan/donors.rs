//! Donors: where each streamed group of a model lives between its uploads, placed by cost.
//!
//! A group that streams is copied onto the execution device on every step from wherever its weights live: a
//! second card over its own link (NVLink, PCIe), pinned host RAM, pageable host RAM, or the checkpoint file. Each
//! such place is a [`Donor`] with a link rate and a latency, drawing on zero or more [`DonorBudget`]s (a second
//! card's memory; host RAM, which pinned and pageable copies share; none for the checkpoint file). The cost of a
//! step is linear in the bytes each donor streams, as ComfyUI-MultiGPU measured on FLUX (1.29 s/it resident, plus
//! 0.02 s/it per GB from a second card over NVLink, 0.06 from RAM over PCIe 4.0 x16, 0.32 from a second card over
//! PCIe 3.0 x8), so a placement's predicted step time is
//!
//! `step = compute + Σ over the streamed groups (bytes ÷ its donor's rate + its donor's latency)`,
//!
//! each group's term counted once per copy where a problem prices several copies (the planner prices an image:
//! a denoiser's groups cross once per step, a text encoder's once).
//!
//! [`DonorProblem::place`] finds the placement that minimises it under every budget, by branch and bound: the
//! groups largest first, each tried on the donors cheapest per byte first, a branch cut where its cost plus a lower
//! bound for the groups left (their bytes poured into the cheapest room as if they could be split, each budget
//! counted whole for every donor drawing on it) cannot beat the best placement found. Groups of equal size are
//! interchangeable, so they take donors in order, which removes their permutations. The search is exact unless it
//! visits [`MAX_NODES`] nodes; then it says so, and the placement's distance from the lower bound is printed.
//! [`DonorProblem::exhaustive`] tries every assignment, for checking the search on small cases.
//!
//! This is policy, like the rest of the planner: it never touches a device. memory-sim's `donors` module runs a
//! placement on simulated cards with links of their own, and `cargo xtask plan --donor` prints one.

use std::fmt::{self, Write as _};

use crate::plan::error::PlanError;
use crate::plan::link::LinkSource;
use crate::size::format_size;

/// The most branch-and-bound nodes [`DonorProblem::place`] visits before it stops with the best placement found.
pub const MAX_NODES: u64 = 2_000_000;

/// The most assignments [`DonorProblem::exhaustive`] enumerates.
pub const MAX_EXHAUSTIVE: u64 = 20_000_000;

/// What kind of memory a donor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DonorKind {
    /// Another device's memory (a second GPU), copied over a device-to-device link.
    Device,
    /// Page-locked host RAM: the link's full rate.
    PinnedRam,
    /// Pageable host RAM: staged by the driver, a share of the link rate.
    PageableRam,
    /// The checkpoint file: read from disk (or the page cache) on every upload; holds any number of groups.
    File,
}

impl fmt::Display for DonorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Self::Device => "card",
            Self::PinnedRam => "pinned RAM",
            Self::PageableRam => "pageable RAM",
            Self::File => "checkpoint file",
        })
    }
}

/// A place streamed groups can live, with the link its copies cross to the execution device.
#[derive(Debug, Clone, PartialEq)]
pub struct Donor {
    /// Its name as printed: `cuda:1`, `pinned`, `ram`, `file`.
    pub name: String,
    /// What kind of memory it is.
    pub kind: DonorKind,
    /// The rate its copies reach on the way to the execution device, bytes per second.
    pub bytes_per_second: f64,
    /// The fixed cost of one copy, seconds.
    pub latency_seconds: f64,
    /// Where the rate came from: measured by a link meter, given (a simulated card, a datasheet) or assumed.
    pub source: LinkSource,
    /// The budgets (indices into [`DonorProblem::budgets`]) every byte it holds counts against; none for a donor
    /// that holds anything (the checkpoint file).
    pub budgets: Vec<usize>,
}

impl Donor {
    /// A donor with a given rate and latency, drawing on no budget yet.
    pub fn new(name: &str, kind: DonorKind, bytes_per_second: f64, latency_seconds: f64) -> Self {
        Self {
            name: name.into(),
            kind,
            bytes_per_second,
            latency_seconds,
            source: LinkSource::Given,
            budgets: Vec::new(),
        }
    }

    /// The same donor, its bytes also counted against `budget` (an index into [`DonorProblem::budgets`]).
    pub fn drawing_on(mut self, budget: usize) -> Self {
        self.budgets.push(budget);
        self
    }

    /// The same donor, its rate from `source`.
    pub fn with_source(mut self, source: LinkSource) -> Self {
        self.source = source;
        self
    }

    /// Seconds one copy of `bytes` from this donor takes.
    pub fn seconds(&self, bytes: u64) -> f64 {
        bytes as f64 / self.bytes_per_second + self.latency_seconds
    }

    /// Seconds per GB streamed, ComfyUI-MultiGPU's figure of merit (latency left out).
    pub fn seconds_per_gb(&self) -> f64 {
        1e9 / self.bytes_per_second
    }
}

/// Memory that one or more donors fill: a card's free memory, host RAM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DonorBudget {
    /// Its name as printed (`cuda:1 memory`, `host RAM`).
    pub name: String,
    /// The bytes the donors drawing on it may hold together.
    pub bytes: u64,
}

impl DonorBudget {
    /// A budget of `bytes`.
    pub fn new(name: &str, bytes: u64) -> Self {
        Self { name: name.into(), bytes }
    }
}

/// One group that streams on every step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamedGroup {
    /// Its name (`layers.7`), printed in the placement.
    pub name: String,
    /// Its weight bytes, copied `copies` times per step.
    pub bytes: u64,
    /// How many times it crosses its donor's link in the time the problem prices (1 by default): a problem
    /// priced per image over several components gives a denoiser's group one copy per step and a text
    /// encoder's one per image, so a byte of budget goes where it is copied most.
    pub copies: u32,
}

impl StreamedGroup {
    /// A group of `bytes`, copied once.
    pub fn new(name: &str, bytes: u64) -> Self {
        Self { name: name.into(), bytes, copies: 1 }
    }

    /// The same group, copied `copies` times (at least once).
    pub fn with_copies(mut self, copies: u32) -> Self {
        self.copies = copies.max(1);
        self
    }

    /// Seconds its copies from `donor` take.
    pub fn seconds_from(&self, donor: &Donor) -> f64 {
        f64::from(self.copies) * donor.seconds(self.bytes)
    }
}

/// What to place: the streamed groups, the donors and their budgets, and the step's compute time.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DonorProblem {
    /// Seconds of compute per step on the execution device (the streamed bytes add to it).
    pub compute_seconds: f64,
    /// The groups that stream, in call order.
    pub groups: Vec<StreamedGroup>,
    /// Where they may live.
    pub donors: Vec<Donor>,
    /// The budgets the donors draw on.
    pub budgets: Vec<DonorBudget>,
}

/// How a placement was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SearchOutcome {
    /// The search finished: no placement has a lower predicted step time.
    Exact {
        /// Branch-and-bound nodes visited.
        nodes: u64,
    },
    /// The search stopped at [`MAX_NODES`]: the best placement found, which the lower bound bounds.
    Truncated {
        /// Nodes visited.
        nodes: u64,
    },
    /// Every assignment was tried ([`DonorProblem::exhaustive`]).
    Exhaustive {
        /// Assignments tried.
        assignments: u64,
    },
}

/// Where each group lives, and what that is predicted to cost per step.
#[derive(Debug, Clone, PartialEq)]
pub struct DonorPlacement {
    /// The donor (an index into [`DonorProblem::donors`]) of each group, in the problem's order.
    pub donor_of: Vec<usize>,
    /// Predicted seconds per step: compute plus every group's copy.
    pub step_seconds: f64,
    /// A lower bound on any placement's step time under the budgets: compute plus the groups' bytes split freely
    /// over the cheapest room. Equal to `step_seconds` only when the groups pack perfectly.
    pub bound_seconds: f64,
    /// How it was found.
    pub search: SearchOutcome,
}

impl DonorPlacement {
    /// Bytes per step streamed from `donor`.
    pub fn bytes_from(&self, problem: &DonorProblem, donor: usize) -> u64 {
        self.groups_from(donor).map(|group| problem.groups[group].bytes).sum()
    }

    /// The groups (indices into [`DonorProblem::groups`]) that live on `donor`, in call order.
    pub fn groups_from(&self, donor: usize) -> impl Iterator<Item = usize> + '_ {
        self.donor_of.iter().enumerate().filter(move |(_, d)| **d == donor).map(|(group, _)| group)
    }
}

impl DonorProblem {
    /// Checks the problem: finite positive rates, finite non-negative latencies and compute, budgets that exist,
    /// groups of a positive size.
    pub fn validate(&self) -> Result<(), PlanError> {
        let invalid = |problem: String| Err(PlanError::InvalidDonors { problem });
        if !(self.compute_seconds.is_finite() && self.compute_seconds >= 0.0) {
            return invalid(format!(
                "compute is {} s per step; give a finite, non-negative time",
                self.compute_seconds
            ));
        }
        if self.donors.is_empty() && !self.groups.is_empty() {
            return invalid("no donor is given; add one (the checkpoint file, host RAM, a second card)".into());
        }
        for donor in &self.donors {
            if !(donor.bytes_per_second.is_finite() && donor.bytes_per_second > 0.0) {
                return invalid(format!(
                    "donor {} has a rate of {} bytes/s; give a finite positive rate (measured or from a datasheet)",
                    donor.name, donor.bytes_per_second
                ));
            }
            if !(donor.latency_seconds.is_finite() && donor.latency_seconds >= 0.0) {
                return invalid(format!(
                    "donor {} has a latency of {} s; give a finite, non-negative latency",
                    donor.name, donor.latency_seconds
                ));
            }
            if let Some(budget) = donor.budgets.iter().find(|b| **b >= self.budgets.len()) {
                return invalid(format!(
                    "donor {} draws on budget #{budget}, but there are {} budgets; add the budget first",
                    donor.name,
                    self.budgets.len()
                ));
            }
        }
        if let Some(group) = self.groups.iter().find(|g| g.bytes == 0) {
            return invalid(format!("group {} has 0 bytes; leave out groups that hold no weights", group.name));
        }
        Ok(())
    }

    /// The predicted step time of an assignment (a donor per group), or `None` where it overfills a budget or
    /// names no donor.
    pub fn step_seconds(&self, donor_of: &[usize]) -> Option<f64> {
        if donor_of.len() != self.groups.len() {
            return None;
        }
        let mut used = vec![0u64; self.budgets.len()];
        let mut seconds = self.compute_seconds;
        for (group, &donor) in self.groups.iter().zip(donor_of) {
            let donor = self.donors.get(donor)?;
            for &budget in &donor.budgets {
                used[budget] = used[budget].saturating_add(group.bytes);
            }
            seconds += group.seconds_from(donor);
        }
        used.iter().zip(&self.budgets).all(|(used, budget)| *used <= budget.bytes).then_some(seconds)
    }

    /// The placement with the lowest predicted step time under every budget (see the module's docs), or a typed
    /// error when the groups cannot be placed at all, naming what the donors hold and what to add.
    pub fn place(&self) -> Result<DonorPlacement, PlanError> {
        self.validate()?;
        let mut search = Search::new(self);
        let bound = search.bound(0).ok_or_else(|| self.too_small())?;
        search.descend(0, self.compute_seconds);
        let nodes = search.nodes;
        let Some((_, order_donors)) = search.best else {
            if search.truncated {
                return Err(PlanError::InvalidDonors {
                    problem: format!(
                        "the search visited {MAX_NODES} nodes without finding a placement that fits the budgets; give \
                         a donor without a budget (the checkpoint file) or fewer, larger groups"
                    ),
                });
            }
            return Err(self.too_small());
        };
        let mut donor_of = vec![0; self.groups.len()];
        for (position, &group) in search.order.iter().enumerate() {
            donor_of[group] = search.donor_order[order_donors[position]];
        }
        let donor_of = self.in_call_order(donor_of);
        let step_seconds = self.step_seconds(&donor_of).expect("the search keeps every budget");
        let outcome =
            if search.truncated { SearchOutcome::Truncated { nodes } } else { SearchOutcome::Exact { nodes } };
        Ok(DonorPlacement { donor_of, step_seconds, bound_seconds: self.compute_seconds + bound, search: outcome })
    }

    /// The best placement found by trying every assignment (donors to the power of groups, at most
    /// [`MAX_EXHAUSTIVE`]), `None` where none fits; for checking [`place`](Self::place) on small cases.
    pub fn exhaustive(&self) -> Result<Option<DonorPlacement>, PlanError> {
        self.validate()?;
        let donors = self.donors.len() as u64;
        let assignments = (0..self.groups.len()).try_fold(1u64, |n, _| n.checked_mul(donors.max(1)));
        let Some(assignments) = assignments.filter(|n| *n <= MAX_EXHAUSTIVE) else {
            return Err(PlanError::InvalidDonors {
                problem: format!(
                    "{} groups over {} donors are too many assignments to try one by one (more than {MAX_EXHAUSTIVE}); \
                     use place, which searches them by branch and bound",
                    self.groups.len(),
                    self.donors.len()
                ),
            });
        };
        let mut donor_of = vec![0usize; self.groups.len()];
        let mut best: Option<(f64, Vec<usize>)> = None;
        for mut code in 0..assignments {
            for slot in donor_of.iter_mut() {
                *slot = (code % donors) as usize;
                code /= donors;
            }
            if let Some(seconds) = self.step_seconds(&donor_of)
                && best.as_ref().is_none_or(|(b, _)| seconds < *b)
            {
                best = Some((seconds, donor_of.clone()));
            }
        }
        let bound = Search::new(self).bound(0).unwrap_or(f64::INFINITY);
        Ok(best.map(|(step_seconds, donor_of)| DonorPlacement {
            donor_of,
            step_seconds,
            bound_seconds: self.compute_seconds + bound,
            search: SearchOutcome::Exhaustive { assignments },
        }))
    }

    /// Equal groups (the same size, copied as often) are interchangeable: hand their donors out in call order, cheapest first, so a donor
    /// holds a run of consecutive groups where it can (the same cost, an easier table to read).
    fn in_call_order(&self, mut donor_of: Vec<usize>) -> Vec<usize> {
        let rank = donor_rank(&self.donors);
        let mut sizes: Vec<(u64, u32)> = self.groups.iter().map(|g| (g.bytes, g.copies)).collect();
        sizes.sort_unstable();
        sizes.dedup();
        for size in sizes {
            let members: Vec<usize> =
                (0..self.groups.len()).filter(|g| (self.groups[*g].bytes, self.groups[*g].copies) == size).collect();
            let mut donors: Vec<usize> = members.iter().map(|g| donor_of[*g]).collect();
            donors.sort_by_key(|d| rank[*d]);
            for (group, donor) in members.into_iter().zip(donors) {
                donor_of[group] = donor;
            }
        }
        donor_of
    }

    fn too_small(&self) -> PlanError {
        let needs: u64 = self.groups.iter().map(|g| g.bytes).sum();
        let largest = self.groups.iter().map(|g| g.bytes).max().unwrap_or(0);
        let budgets: Vec<String> =
            self.budgets.iter().map(|b| format!("{} {}", b.name, format_size(b.bytes))).collect();
        PlanError::DonorsTooSmall {
            groups: self.groups.len(),
            needs,
            largest,
            budgets: if budgets.is_empty() { "none".into() } else { budgets.join(", ") },
        }
    }

    /// The placement as a table, one row per donor (what kind, its link, its budget, the groups it holds, their
    /// bytes and seconds per step), the step's prediction against the bound, and why each donor holds what it
    /// holds.
    pub fn explain(&self, placement: &DonorPlacement) -> String {
        let mut rows = vec![[
            "donor".to_string(),
            "kind".into(),
            "link".into(),
            "budget".into(),
            "groups".into(),
            "bytes/step".into(),
            "copies/step".into(),
        ]];
        for (index, donor) in self.donors.iter().enumerate() {
            let groups: Vec<usize> = placement.groups_from(index).collect();
            let bytes: u64 = groups.iter().map(|g| u64::from(self.groups[*g].copies) * self.groups[*g].bytes).sum();
            let seconds = groups.iter().map(|g| self.groups[*g].seconds_from(donor)).fold(0.0, |sum, s| sum + s);
            rows.push([
                donor.name.clone(),
                donor.kind.to_string(),
                crate::format_rate(donor.bytes_per_second),
                self.budget_of(donor).map_or_else(|| "unbounded".into(), format_size),
                names(groups.iter().map(|g| self.groups[*g].name.as_str())),
                format_size(bytes),
                format!("{seconds:.3} s"),
            ]);
        }
        let widths: Vec<usize> = (0..7).map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0)).collect();
        let mut out = String::new();
        for row in &rows {
            let line: Vec<String> = row.iter().zip(&widths).map(|(cell, width)| format!("{cell:<width$}")).collect();
            let _ = writeln!(out, "{}", line.join("  ").trim_end());
        }
        let search = match placement.search {
            SearchOutcome::Exact { nodes } => format!("exact: branch and bound, {nodes} nodes"),
            SearchOutcome::Truncated { nodes } => {
                format!("best found in {nodes} nodes, the search's limit: within the bound, not proven optimal")
            }
            SearchOutcome::Exhaustive { assignments } => format!("every one of {assignments} assignments tried"),
        };
        let _ = writeln!(
            out,
            "step: {:.3} s predicted ({:.3} s compute + {:.3} s copies); lower bound {:.3} s; placement {search}",
            placement.step_seconds,
            self.compute_seconds,
            placement.step_seconds - self.compute_seconds,
            placement.bound_seconds,
        );
        out.push_str("why:\n");
        let rank = donor_rank(&self.donors);
        let mut by_cost: Vec<usize> = (0..self.donors.len()).collect();
        by_cost.sort_by_key(|d| rank[*d]);
        for (position, &index) in by_cost.iter().enumerate() {
            let donor = &self.donors[index];
            let bytes = placement.bytes_from(self, index);
            let cost = format!("{:.3} s per GB streamed ({}, {})", donor.seconds_per_gb(), donor.kind, donor.source);
            let cheaper =
                if position == 0 { "the cheapest donor".to_string() } else { format!("#{} by cost", position + 1) };
            let reason = match (bytes, self.budget_of(donor)) {
                _ if self.groups.is_empty() => "holds nothing: no group streams".to_string(),
                (0, _) if position == 0 => format!("{cheaper}, but no group fits in its budget"),
                (0, _) => "holds nothing: the cheaper donors hold every group".to_string(),
                (_, None) => "holds what the cheaper donors' budgets leave".to_string(),
                (_, Some(budget)) => format!("{cheaper}, filled to {} of {}", format_size(bytes), format_size(budget)),
            };
            let _ = writeln!(out, "  {}: {cost}; {reason}", donor.name);
        }
        out
    }

    /// The smallest budget a donor draws on, `None` for an unbounded one.
    fn budget_of(&self, donor: &Donor) -> Option<u64> {
        donor.budgets.iter().map(|b| self.budgets[*b].bytes).min()
    }
}

/// Each donor's rank by cost per byte, then by latency, then by its index: the order the search tries them in.
fn donor_rank(donors: &[Donor]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..donors.len()).collect();
    order.sort_by(|a, b| {
        let (a, b) = (&donors[*a], &donors[*b]);
        b.bytes_per_second.total_cmp(&a.bytes_per_second).then(a.latency_seconds.total_cmp(&b.latency_seconds))
    });
    let mut rank = vec![0; donors.len()];
    for (position, donor) in order.into_iter().enumerate() {
        rank[donor] = position;
    }
    rank
}

/// Names of groups, a run of `prefix.N`, `prefix.N+1`, … written `prefix.N-M`.
fn names<'a>(names: impl Iterator<Item = &'a str>) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut run: Option<(&str, u64, u64)> = None;
    let close = |run: Option<(&str, u64, u64)>, parts: &mut Vec<String>| match run {
        Some((prefix, first, last)) if first == last => parts.push(format!("{prefix}.{first}")),
        Some((prefix, first, last)) => parts.push(format!("{prefix}.{first}-{last}")),
        None => {}
    };
    for name in names {
        let indexed = name.rsplit_once('.').and_then(|(prefix, n)| n.parse::<u64>().ok().map(|n| (prefix, n)));
        match (indexed, run) {
            (Some((prefix, n)), Some((p, first, last))) if p == prefix && n == last + 1 => {
                run = Some((p, first, n));
            }
            (Some((prefix, n)), _) => {
                close(run.take(), &mut parts);
                run = Some((prefix, n, n));
            }
            (None, _) => {
                close(run.take(), &mut parts);
                parts.push(name.to_string());
            }
        }
    }
    close(run, &mut parts);
    if parts.is_empty() { "-".into() } else { parts.join(" ") }
}

/// The branch-and-bound state.
struct Search<'a> {
    problem: &'a DonorProblem,
    /// Group indices, the most copied first, then the largest.
    order: Vec<usize>,
    /// Donor indices, cheapest per byte first.
    donor_order: Vec<usize>,
    /// Copies of the groups from each position of `order` on.
    suffix_copies: Vec<u64>,
    /// The smallest latency of any donor: every group left pays at least it.
    min_latency: f64,
    /// Bytes held per budget on the current branch.
    used: Vec<u64>,
    /// The current branch: a position in `donor_order` per position in `order`.
    current: Vec<usize>,
    best: Option<(f64, Vec<usize>)>,
    nodes: u64,
    truncated: bool,
}

impl<'a> Search<'a> {
    fn new(problem: &'a DonorProblem) -> Self {
        // The most copied first, then the largest: the groups left at any position are then in the order the
        // bound pours them.
        let mut order: Vec<usize> = (0..problem.groups.len()).collect();
        order.sort_by(|a, b| {
            let (a, b) = (&problem.groups[*a], &problem.groups[*b]);
            b.copies.cmp(&a.copies).then(b.bytes.cmp(&a.bytes))
        });
        let rank = donor_rank(&problem.donors);
        let mut donor_order: Vec<usize> = (0..problem.donors.len()).collect();
        donor_order.sort_by_key(|d| rank[*d]);
        let mut suffix_copies = vec![0u64; order.len() + 1];
        for position in (0..order.len()).rev() {
            suffix_copies[position] = suffix_copies[position + 1] + u64::from(problem.groups[order[position]].copies);
        }
        let min_latency = problem.donors.iter().map(|d| d.latency_seconds).fold(f64::INFINITY, f64::min);
        Self {
            problem,
            current: vec![0; order.len()],
            order,
            donor_order,
            suffix_copies,
            min_latency: if min_latency.is_finite() { min_latency } else { 0.0 },
            used: vec![0; problem.budgets.len()],
            best: None,
            nodes: 0,
            truncated: false,
        }
    }

    /// Room left on `donor` on this branch: the least any of its budgets has left.
    fn room(&self, donor: &Donor) -> u64 {
        donor.budgets.iter().map(|b| self.problem.budgets[*b].bytes - self.used[*b]).min().unwrap_or(u64::MAX)
    }

    /// A lower bound on the copy seconds of the groups from `position` on, or `None` where even split freely they
    /// do not fit: their bytes poured, the most copied first, into the donors cheapest first, each donor's room
    /// counted as if no other donor drew on its budgets (a relaxation: never more than any real placement costs;
    /// with costs of the form copies times seconds per byte, pouring the most copied bytes into the cheapest room
    /// is the cheapest split).
    fn bound(&self, position: usize) -> Option<f64> {
        let mut seconds = self.suffix_copies[position] as f64 * self.min_latency;
        let mut rooms = self.donor_order.iter().map(|&index| {
            let donor = &self.problem.donors[index];
            (self.room(donor), donor.bytes_per_second)
        });
        let mut room = rooms.next();
        for &group in &self.order[position..] {
            let group = &self.problem.groups[group];
            let mut left = group.bytes;
            while left > 0 {
                let (free, rate) = room.as_mut()?;
                let take = left.min(*free);
                seconds += f64::from(group.copies) * take as f64 / *rate;
                left -= take;
                *free -= take;
                if *free == 0 {
                    room = rooms.next();
                }
            }
        }
        Some(seconds)
    }

    fn descend(&mut self, position: usize, cost: f64) {
        self.nodes += 1;
        if self.nodes > MAX_NODES {
            self.truncated = true;
            return;
        }
        if position == self.order.len() {
            if self.best.as_ref().is_none_or(|(best, _)| cost < *best) {
                self.best = Some((cost, self.current.clone()));
            }
            return;
        }
        let Some(bound) = self.bound(position) else { return };
        if let Some((best, _)) = &self.best
            && cost + bound >= *best * (1.0 - 1e-12)
        {
            return;
        }
        let problem = self.problem;
        let group = &problem.groups[self.order[position]];
        let bytes = group.bytes;
        // Equal groups take donors in order: the permutations among them cost the same.
        let first = match position.checked_sub(1) {
            Some(previous)
                if problem.groups[self.order[previous]].bytes == bytes
                    && problem.groups[self.order[previous]].copies == group.copies =>
            {
                self.current[previous]
            }
            _ => 0,
        };
        for slot in first..self.donor_order.len() {
            let donor = &problem.donors[self.donor_order[slot]];
            if self.room(donor) < bytes {
                continue;
            }
            for b in &donor.budgets {
                self.used[*b] += bytes;
            }
            self.current[position] = slot;
            self.descend(position + 1, cost + group.seconds_from(donor));
            for b in &donor.budgets {
                self.used[*b] -= bytes;
            }
            if self.truncated {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GiB, which `format_size` prints as GB, the way diffusers does.
    const GB: u64 = 1 << 30;

    /// The issue's three-donor machine: a second card over NVLink, host RAM over PCIe 4.0 x16, a second card
    /// over PCIe 3.0 x8, at ComfyUI-MultiGPU's published costs per GB.
    fn distorch(groups: usize, group_bytes: u64, nvlink_gb: u64, ram_gb: u64) -> DonorProblem {
        DonorProblem {
            compute_seconds: 1.29,
            groups: (0..groups).map(|i| StreamedGroup::new(&format!("layers.{i}"), group_bytes)).collect(),
            donors: vec![
                Donor::new("pcie3-card", DonorKind::Device, 1e9 / 0.32, 0.0).drawing_on(2),
                Donor::new("ram", DonorKind::PageableRam, 1e9 / 0.06, 0.0).drawing_on(1),
                Donor::new("nvlink-card", DonorKind::Device, 1e9 / 0.02, 0.0).drawing_on(0),
            ],
            budgets: vec![
                DonorBudget::new("nvlink-card memory", nvlink_gb * GB),
                DonorBudget::new("host RAM", ram_gb * GB),
                DonorBudget::new("pcie3-card memory", 24 * GB),
            ],
        }
    }

    #[test]
    fn a_second_card_over_pcie3_is_a_worse_donor_than_ram() {
        let problem = distorch(12, GB, 4, 6);
        let placement = problem.place().unwrap();
        assert_eq!(placement.bytes_from(&problem, 2), 4 * GB, "NVLink first, to its budget");
        assert_eq!(placement.bytes_from(&problem, 1), 6 * GB, "then RAM");
        assert_eq!(placement.bytes_from(&problem, 0), 2 * GB, "the PCIe 3.0 card last");
        let gb = GB as f64 / 1e9;
        let expected = 1.29 + gb * (4.0 * 0.02 + 6.0 * 0.06 + 2.0 * 0.32);
        assert!((placement.step_seconds - expected).abs() < 1e-9, "{}", placement.step_seconds);
        assert!(matches!(placement.search, SearchOutcome::Exact { .. }));
        assert!((placement.bound_seconds - expected).abs() < 1e-9, "equal groups pack perfectly");
    }

    #[test]
    fn packing_beats_filling_the_cheapest_donor_with_the_largest_group_first() {
        // The cheap donor holds 10: 6 first would leave 4 unused; 5 + 5 fill it.
        let problem = DonorProblem {
            compute_seconds: 0.0,
            groups: [6, 5, 5].iter().enumerate().map(|(i, b)| StreamedGroup::new(&format!("g.{i}"), *b)).collect(),
            donors: vec![
                Donor::new("fast", DonorKind::Device, 10.0, 0.0).drawing_on(0),
                Donor::new("file", DonorKind::File, 1.0, 0.0),
            ],
            budgets: vec![DonorBudget::new("fast memory", 10)],
        };
        let placement = problem.place().unwrap();
        assert_eq!(placement.donor_of, [1, 0, 0]);
        assert!((placement.step_seconds - (1.0 + 6.0)).abs() < 1e-12);
        let exhaustive = problem.exhaustive().unwrap().unwrap();
        assert!((exhaustive.step_seconds - placement.step_seconds).abs() < 1e-12);
        assert!(placement.bound_seconds <= placement.step_seconds + 1e-12);
    }

    #[test]
    fn shared_budgets_hold_pinned_and_pageable_copies_together() {
        let problem = DonorProblem {
            compute_seconds: 0.5,
            groups: (0..4).map(|i| StreamedGroup::new(&format!("b.{i}"), 2 * GB)).collect(),
            donors: vec![
                Donor::new("pinned", DonorKind::PinnedRam, 20e9, 1e-5).drawing_on(0).drawing_on(1),
                Donor::new("ram", DonorKind::PageableRam, 10e9, 1e-5).drawing_on(0),
                Donor::new("file", DonorKind::File, 2e9, 1e-4),
            ],
            budgets: vec![DonorBudget::new("host RAM", 6 * GB), DonorBudget::new("pinning limit", 2 * GB)],
        };
        let placement = problem.place().unwrap();
        assert_eq!(placement.donor_of, [0, 1, 1, 2], "one pinned, RAM to 6 GB, the rest from the file");
        let exhaustive = problem.exhaustive().unwrap().unwrap();
        assert!((exhaustive.step_seconds - placement.step_seconds).abs() < 1e-12);
    }

    #[test]
    fn groups_that_fit_nowhere_are_a_typed_error_naming_the_budgets() {
        let mut problem = distorch(4, 10 * GB, 4, 6);
        problem.donors.remove(0);
        let err = problem.place().unwrap_err();
        let message = err.to_string();
        assert!(matches!(err, PlanError::DonorsTooSmall { groups: 4, .. }), "{message}");
        assert!(message.contains("host RAM 6.00 GB") && message.contains("checkpoint file"), "{message}");
        problem.donors[0].bytes_per_second = f64::NAN;
        assert!(matches!(problem.place(), Err(PlanError::InvalidDonors { .. })));
    }

    #[test]
    fn the_table_names_where_each_group_lives_and_why() {
        let problem = distorch(12, GB, 4, 6);
        let text = problem.explain(&problem.place().unwrap());
        expect_test::expect![[r#"
            donor        kind          link        budget    groups        bytes/step  copies/step
            pcie3-card   card          3.12 GB/s   24.00 GB  layers.10-11  2.00 GB     0.687 s
            ram          pageable RAM  16.67 GB/s  6.00 GB   layers.4-9    6.00 GB     0.387 s
            nvlink-card  card          50.00 GB/s  4.00 GB   layers.0-3    4.00 GB     0.086 s
            step: 2.450 s predicted (1.290 s compute + 1.160 s copies); lower bound 2.450 s; placement exact: branch and bound, 27 nodes
            why:
              nvlink-card: 0.020 s per GB streamed (card, given); the cheapest donor, filled to 4.00 GB of 4.00 GB
              ram: 0.060 s per GB streamed (pageable RAM, given); #2 by cost, filled to 6.00 GB of 6.00 GB
              pcie3-card: 0.320 s per GB streamed (card, given); #3 by cost, filled to 2.00 GB of 24.00 GB
        "#]]
        .assert_eq(&text);
    }

    /// A small deterministic generator, so the comparison below covers the same cases on every run.
    struct XorShift(u64);

    impl XorShift {
        fn next(&mut self, below: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % below
        }
    }

    #[test]
    fn branch_and_bound_equals_an_exhaustive_search_on_small_cases() {
        let mut random = XorShift(0x9E37_79B9_7F4A_7C15);
        let (mut compared, mut infeasible) = (0, 0);
        for _ in 0..400 {
            let groups = 1 + random.next(7) as usize;
            let donors = 1 + random.next(4) as usize;
            let budgets = random.next(3) as usize;
            let weighted = random.next(2) == 0;
            let problem = DonorProblem {
                compute_seconds: random.next(100) as f64 / 10.0,
                groups: (0..groups)
                    .map(|i| {
                        let group = StreamedGroup::new(&format!("g.{i}"), 1 + random.next(4) * random.next(5));
                        // Half the cases price groups copied a different number of times (a denoiser's per
                        // step, a text encoder's once).
                        group.with_copies(if weighted { 1 + random.next(8) as u32 } else { 1 })
                    })
                    .collect(),
                donors: (0..donors)
                    .map(|d| {
                        let mut donor =
                            Donor::new(&format!("d{d}"), DonorKind::Device, 1.0 + random.next(50) as f64, 0.0);
                        donor.latency_seconds = random.next(3) as f64 * 0.1;
                        for b in 0..budgets {
                            if random.next(2) == 0 {
                                donor = donor.drawing_on(b);
                            }
                        }
                        donor
                    })
                    .collect(),
                budgets: (0..budgets).map(|b| DonorBudget::new(&format!("m{b}"), random.next(25))).collect(),
            };
            let exhaustive = problem.exhaustive().unwrap();
            match (problem.place(), exhaustive) {
                (Ok(placed), Some(best)) => {
                    compared += 1;
                    assert!(matches!(placed.search, SearchOutcome::Exact { .. }));
                    let tolerance = 1e-9 * best.step_seconds.max(1.0);
                    assert!((placed.step_seconds - best.step_seconds).abs() <= tolerance, "{problem:?}");
                    assert!(placed.bound_seconds <= best.step_seconds + tolerance, "the bound is a bound: {problem:?}");
                    assert_eq!(problem.step_seconds(&placed.donor_of), Some(placed.step_seconds));
                }
                (Err(PlanError::DonorsTooSmall { .. }), None) => infeasible += 1,
                (placed, best) => panic!("place {placed:?} against exhaustive {best:?} for {problem:?}"),
            }
        }
        assert!(compared > 200 && infeasible > 10, "{compared} compared, {infeasible} infeasible");
    }

    #[test]
    fn a_byte_of_cheap_room_goes_to_the_group_copied_most() {
        // 4 GB of RAM for a denoiser's 4 GB of groups copied 8 times an image and a text encoder's 4 GB copied
        // once: the denoiser's take the RAM, the text encoder reads its file.
        let groups = vec![
            StreamedGroup::new("text_encoder.0", 4 * GB),
            StreamedGroup::new("transformer.0", 2 * GB).with_copies(8),
            StreamedGroup::new("transformer.1", 2 * GB).with_copies(8),
        ];
        let problem = DonorProblem {
            compute_seconds: 0.0,
            groups,
            donors: vec![
                Donor::new("ram", DonorKind::PageableRam, 16e9, 0.0).drawing_on(0),
                Donor::new("file", DonorKind::File, 2e9, 0.0),
            ],
            budgets: vec![DonorBudget::new("host RAM", 4 * GB)],
        };
        let placement = problem.place().unwrap();
        assert_eq!(placement.donor_of, [1, 0, 0]);
        let expected = 4.0 * GB as f64 / 2e9 + 8.0 * 4.0 * GB as f64 / 16e9;
        assert!((placement.step_seconds - expected).abs() < 1e-9, "{}", placement.step_seconds);
        let exhaustive = problem.exhaustive().unwrap().unwrap();
        assert!((exhaustive.step_seconds - placement.step_seconds).abs() < 1e-9);
    }

    #[test]
    fn runs_of_indexed_names_are_written_as_ranges() {
        assert_eq!(names(["layers.0", "layers.1", "layers.2", "x", "layers.4"].into_iter()), "layers.0-2 x layers.4");
        assert_eq!(names(std::iter::empty()), "-");
    }
}
