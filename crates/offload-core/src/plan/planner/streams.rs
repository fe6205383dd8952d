//! Where the streamed groups' copies come from: host RAM, the checkpoint file, or a further device's memory
//! ([`Machine::peers`](crate::plan::Machine::peers)), placed by cost.
//!
//! Two passes, each one [`DonorProblem`] with every group weighted by its copies per image (a byte saves the most
//! where it crosses the link most often):
//! - **the split** ([`Planner::split_streams`]), where the host copies do not fit in RAM: the streamed groups of
//!   every component that reads the disk, over the RAM the copies kept whole leave (pageable copies), the file
//!   (the read, then a pageable copy) and the peers;
//! - **the peers** ([`Planner::place_on_peers`]), once the copies are pinned: the streamed groups of each other
//!   group-offloaded component, most copies per image first, over what the peers have left and the sources the
//!   plan already gave it (its pinned bytes at the link's rate, its copies in RAM, its file).
//!
//! A peer slower than the host's sources (a second card over PCIe 3.0 x8 against RAM over PCIe 4.0 x16) holds
//! nothing. Each placement is kept only where the full time model, prefetch hiding copies under compute, predicts
//! less time per image.
//!
//! A run follows a placement by the groups' sizes: group offload pins its first streamed groups while they fit the
//! pinned budget, then puts each group it uploads on the first of the component's donors and its RAM budget that
//! takes it, in call order, a pinned group staying with the host. Where the layout gives every group's size, each
//! donor and RAM are given the sizes of the groups the search placed there (`GroupOptions::donor_groups`,
//! `ram_groups`) and take only groups of those sizes, one each, so the run keeps exactly the search's placement
//! (groups of one size are interchangeable: they cost the same anywhere); where the sizes are estimates, each takes
//! groups while its budget has room. The shares the plan reports are what that rule keeps ([`run_keeps`]), and a
//! component whose groups go to a peer pins only what the placement still copies from pinned memory.

use super::{Choice, Planner, Shape, evaluate, exact_sizes, fs, join_and, streamed_groups};
use crate::plan::component::{ComponentSpec, Route};
use crate::plan::donors::{Donor, DonorBudget, DonorKind, DonorPlacement, DonorProblem, StreamedGroup};
use crate::plan::link::LinkSource;
use crate::plan::machine::{PeerDevice, PeerShare};

impl Planner<'_> {
    /// Places `left` bytes of RAM and the peers' memory over the streamed groups of the group-offloaded
    /// components whose copies read the disk (a split; at leaf level each leaf by its size where the layout gives
    /// it), see the module's docs. The split is kept only where it lowers the predicted time per image (the page
    /// cache shrinks by what RAM takes); each component's shares are set in its shape, and the reason for each one
    /// that keeps groups in RAM is returned (what it holds on peers is its `peer_note`).
    pub(super) fn split_streams(
        &self,
        components: &[ComponentSpec],
        choices: &mut [Choice],
        left: u64,
    ) -> Vec<Option<String>> {
        let time = self.machine.time;
        let peers = &self.machine.peers;
        let mut notes = vec![None; components.len()];
        // Each candidate's streamed groups in the layout's order: the groups its resident budget does not keep.
        let streamed: Vec<(usize, Vec<u64>)> = (components.iter().zip(choices.iter()).enumerate())
            .filter(|(_, (_, choice))| choice.shape.host_tier.reads_disk())
            .filter_map(|(i, (spec, choice))| streamed_groups(spec, &choice.shape).map(|groups| (i, groups)))
            .collect();
        if streamed.is_empty() || (left == 0 && peers.iter().all(|peer| peer.bytes == 0)) {
            return notes;
        }
        let pageable = time.pageable_bytes_per_second();
        let from_disk = 1.0 / (1.0 / time.disk_bytes_per_second + 1.0 / pageable);
        let mut problem = DonorProblem {
            compute_seconds: 0.0,
            groups: streamed
                .iter()
                .flat_map(|(i, groups)| {
                    let (name, calls) = (&components[*i].name, components[*i].calls_per_image);
                    groups
                        .iter()
                        .enumerate()
                        .map(move |(g, bytes)| StreamedGroup::new(&format!("{name}.{g}"), *bytes).with_copies(calls))
                })
                .collect(),
            donors: vec![
                Donor::new("ram", DonorKind::PageableRam, pageable, time.link_latency_seconds)
                    .with_source(time.link_source)
                    .drawing_on(0),
                Donor::new("file", DonorKind::File, from_disk, time.link_latency_seconds).with_source(time.disk_source),
            ],
            budgets: vec![DonorBudget::new("host RAM", left)],
        };
        let first_peer = problem.donors.len();
        add_peers(&mut problem, peers, &peers.iter().map(|peer| peer.bytes).collect::<Vec<_>>());
        let Ok(placement) = problem.place() else { return notes };
        // Every copy that reads the disk shares the page cache the split shrinks: each is priced before and after.
        let readers: Vec<usize> = (0..components.len())
            .filter(|&i| {
                choices[i].shape.host_tier.reads_disk()
                    && !matches!(choices[i].shape.route, Route::Resident | Route::Off)
            })
            .collect();
        let seconds = |shapes: &[Shape]| -> f64 {
            readers
                .iter()
                .map(|&i| {
                    let spec = &components[i];
                    evaluate(spec, &shapes[i], choices[i].headroom, &time).per_image_seconds(spec.calls_per_image)
                })
                .sum()
        };
        let mut unsplit: Vec<Shape> = choices.iter().map(|c| c.shape.clone()).collect();
        for &i in &readers {
            unsplit[i].page_cache = left;
        }
        let before = seconds(&unsplit);
        // Each component's shares, as the run's rule keeps them: its peers' first, then RAM's.
        let mut kept = Vec::new();
        let mut first = 0;
        for (i, groups) in &streamed {
            let mine = first..first + groups.len();
            first += groups.len();
            let exact = exact_sizes(&components[*i], &choices[*i].shape);
            let mut holders: Vec<usize> = (first_peer..problem.donors.len()).collect();
            holders.push(0);
            let rooms: Vec<Room> =
                holders.iter().map(|&d| Room::placed(&placement, &problem, d, &mine, exact)).collect();
            kept.push((*i, groups.len(), run_keeps(groups, &rooms), exact));
        }
        let taken: u64 = kept.iter().map(|(_, _, held, _)| held[peers.len()].iter().sum::<u64>()).sum();
        let on_peers: u64 = kept.iter().map(|(_, _, held, _)| held[..peers.len()].iter().flatten().sum::<u64>()).sum();
        let mut split = unsplit;
        for (i, _, held, _) in &kept {
            split[*i].ram_streamed = held[peers.len()].iter().sum();
            split[*i].peers =
                (held.iter().zip(peers)).map(|(held, peer)| (held.iter().sum(), peer.bytes_per_second)).collect();
        }
        for &i in &readers {
            split[i].page_cache = left - taken;
        }
        let after = seconds(&split);
        if (taken == 0 && on_peers == 0) || after >= before * (1.0 - 1e-9) {
            return notes;
        }
        let in_ram: Vec<&str> = (kept.iter())
            .filter(|(_, _, held, _)| !held[peers.len()].is_empty())
            .map(|(i, ..)| components[*i].name.as_str())
            .collect();
        let all = if in_ram.len() > 1 { format!(" in all ({})", join_and(&in_ram)) } else { String::new() };
        let host_rates = format!(
            "{:.3} s per GB from RAM, {:.3} s per GB from disk",
            problem.donors[0].seconds_per_gb(),
            problem.donors[1].seconds_per_gb()
        );
        for (i, total, held, exact) in kept {
            choices[i].shape.ram_streamed = split[i].ram_streamed;
            choices[i].shape.peers = split[i].peers.clone();
            let calls = components[i].calls_per_image;
            let shares = shares(peers, &held[..peers.len()], exact);
            if shares.iter().any(|share| share.bytes > 0) {
                choices[i].peer_note = Some(peer_note(&shares, peers, total, &host_rates, calls, None));
            }
            choices[i].peer_shares = shares;
            let in_ram = &held[peers.len()];
            let (ram, count) = (in_ram.iter().sum::<u64>(), in_ram.len());
            if ram == 0 {
                continue;
            }
            if exact {
                choices[i].ram_groups = in_ram.clone();
            }
            notes[i] = Some(format!(
                "{count} of its {total} streamed groups ({}) keep their host copy in RAM after their first read: the \
                 {} of RAM the other copies leave is placed over the streamed groups by cost, RAM at {:.3} s per GB \
                 against {:.3} s per GB from disk, each group counted once per copy ({calls} an image), which saves \
                 {:.2} s per image{all} over leaving that RAM to the page cache",
                fs(ram),
                fs(left),
                problem.donors[0].seconds_per_gb(),
                problem.donors[1].seconds_per_gb(),
                before - after
            ));
        }
        notes
    }

    /// Places the streamed groups of every group-offloaded component the split did not place over the machine's
    /// peers and the host's sources the plan gave it (see the module's docs); sets each kept placement in the
    /// component's shape, with its reason.
    pub(super) fn place_on_peers(&self, components: &[ComponentSpec], choices: &mut [Choice]) {
        let peers = &self.machine.peers;
        if peers.is_empty() {
            return;
        }
        let time = self.machine.time;
        // What the split left on each peer.
        let mut left: Vec<u64> = (peers.iter().enumerate())
            .map(|(p, peer)| {
                peer.bytes - choices.iter().filter_map(|c| c.peer_shares.get(p)).map(|s| s.bytes).sum::<u64>()
            })
            .collect();
        let mut order: Vec<usize> = (0..components.len())
            .filter(|&i| choices[i].shape.route.is_group_offload() && choices[i].peer_shares.is_empty())
            .collect();
        order.sort_by_key(|&i| std::cmp::Reverse(components[i].calls_per_image));
        for i in order {
            let (spec, choice) = (&components[i], &choices[i]);
            let Some(groups) = streamed_groups(spec, &choice.shape) else { continue };
            let shape = &choice.shape;
            let mut problem = DonorProblem {
                compute_seconds: 0.0,
                groups: (groups.iter().enumerate())
                    .map(|(g, &bytes)| {
                        StreamedGroup::new(&format!("{}.{g}", spec.name), bytes).with_copies(spec.calls_per_image)
                    })
                    .collect(),
                ..DonorProblem::default()
            };
            add_peers(&mut problem, peers, &left);
            let host = |name: &str, kind: DonorKind, rate: f64, budget: Option<u64>, problem: &mut DonorProblem| {
                let mut donor = Donor::new(name, kind, rate, time.link_latency_seconds);
                if let Some(bytes) = budget {
                    problem.budgets.push(DonorBudget::new(&format!("{name} budget"), bytes));
                    donor = donor.drawing_on(problem.budgets.len() - 1);
                }
                problem.donors.push(donor);
            };
            let pageable = time.pageable_bytes_per_second();
            if shape.pinned > 0 {
                host("pinned", DonorKind::PinnedRam, time.link_bytes_per_second, Some(shape.pinned), &mut problem);
            }
            let reads_disk = shape.host_tier.reads_disk();
            if !reads_disk {
                host("ram", DonorKind::PageableRam, pageable, None, &mut problem);
            } else {
                if shape.ram_streamed > 0 {
                    host("ram", DonorKind::PageableRam, pageable, Some(shape.ram_streamed), &mut problem);
                }
                let from_disk = 1.0 / (1.0 / time.disk_bytes_per_second + 1.0 / pageable);
                host("file", DonorKind::File, from_disk, None, &mut problem);
            }
            let host_rates: Vec<String> = (problem.donors.iter().skip(peers.len()))
                .map(|donor| format!("{:.3} s per GB from {}", donor.seconds_per_gb(), donor.kind))
                .collect();
            let host_rates = host_rates.join(", ");
            let Ok(placement) = problem.place() else { continue };
            let all = 0..groups.len();
            // The run pins its first groups up to the pinned bytes the placement uses, then puts the next ones on
            // the peers: the pinned budget shrinks to what the host still serves from it.
            let pinned = (problem.donors.iter().position(|d| d.kind == DonorKind::PinnedRam))
                .map_or(0, |d| bytes_from(&placement, &problem, d, &all));
            let exact = exact_sizes(spec, shape);
            let pinned_at = problem.donors.iter().position(|d| d.kind == DonorKind::PinnedRam);
            let pinned_slots = pinned_at.map(|d| Room::placed(&placement, &problem, d, &all, exact).slots);
            let mut rooms = vec![Room { budget: pinned, slots: pinned_slots.flatten() }];
            rooms.extend((0..peers.len()).map(|p| Room::placed(&placement, &problem, p, &all, exact)));
            let held = run_keeps(&groups, &rooms);
            let (pinned_held, held) = (&held[0], &held[1..]);
            let pinned = pinned_held.iter().sum::<u64>();
            let shares = shares(peers, held, exact);
            if shares.iter().all(|share| share.bytes == 0) {
                let rates: Vec<String> =
                    (peers.iter()).map(|peer| format!("{} from {}", peer_rate(peer), peer.name)).collect();
                choices[i].peer_note = Some(format!(
                    "no streamed group is held on {}: the host's copies cost less, or the peers are full ({} against \
                     {host_rates})",
                    names(peers),
                    rates.join(", ")
                ));
                continue;
            }
            let mut placed = shape.clone();
            placed.peers =
                (shares.iter().zip(peers)).map(|(share, peer)| (share.bytes, peer.bytes_per_second)).collect();
            placed.pinned = placed.pinned.min(pinned);
            let calls = spec.calls_per_image;
            let before = evaluate(spec, shape, choice.headroom, &time).per_image_seconds(calls);
            let after = evaluate(spec, &placed, choice.headroom, &time).per_image_seconds(calls);
            if after >= before * (1.0 - 1e-9) {
                choices[i].peer_note = Some(format!(
                    "no streamed group is held on {}: its copies hide under compute as they are, so a peer would save \
                     nothing per image",
                    names(peers)
                ));
                continue;
            }
            for (p, share) in shares.iter().enumerate() {
                left[p] -= share.bytes;
            }
            let saving = Some(before - after);
            let mut note = peer_note(&shares, peers, groups.len(), &host_rates, calls, saving);
            if placed.pinned < shape.pinned {
                note.push_str(&format!(
                    "; its pinned budget shrinks from {} to {}: the groups on the peers need none",
                    fs(shape.pinned),
                    fs(placed.pinned)
                ));
            }
            choices[i].peer_note = Some(note);
            choices[i].shape = placed;
            choices[i].peer_shares = shares;
            if exact && !pinned_held.is_empty() {
                choices[i].pinned_groups = pinned_held.clone();
            }
        }
    }
}

/// Adds one donor per peer to `problem`, each drawing on a budget of its own of `left` bytes.
fn add_peers(problem: &mut DonorProblem, peers: &[PeerDevice], left: &[u64]) {
    for (peer, &bytes) in peers.iter().zip(left) {
        problem.budgets.push(DonorBudget::new(&format!("{} memory", peer.name), bytes));
        problem.donors.push(
            Donor::new(&peer.name, DonorKind::Device, peer.bytes_per_second, peer.latency_seconds)
                .with_source(peer.source)
                .drawing_on(problem.budgets.len() - 1),
        );
    }
}

/// The bytes of the groups in `groups` (indices into the problem's groups) that `placement` puts on `donor`.
fn bytes_from(
    placement: &DonorPlacement,
    problem: &DonorProblem,
    donor: usize,
    groups: &std::ops::Range<usize>,
) -> u64 {
    groups.clone().filter(|&g| placement.donor_of[g] == donor).map(|g| problem.groups[g].bytes).sum()
}

/// One of the places a run keeps a component's streamed groups in (the pinned budget, a donor, the RAM budget):
/// up to `budget` bytes and, where the sizes are known exactly, only groups of the sizes in `slots`, one each.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Room {
    pub budget: u64,
    pub slots: Option<Vec<u64>>,
}

impl Room {
    /// The room a run is given for what `placement` puts on `donor` of `groups` (indices into the problem's
    /// groups): their bytes, and their sizes where `exact`.
    fn placed(
        placement: &DonorPlacement,
        problem: &DonorProblem,
        donor: usize,
        groups: &std::ops::Range<usize>,
        exact: bool,
    ) -> Self {
        let sizes = groups.clone().filter(|&g| placement.donor_of[g] == donor).map(|g| problem.groups[g].bytes);
        Self { budget: bytes_from(placement, problem, donor, groups), slots: exact.then(|| sizes.collect()) }
    }

    /// Takes `group` where the budget has room and, with slots, one of its size is open.
    fn takes(&mut self, group: u64) -> bool {
        if group > self.budget {
            return false;
        }
        if let Some(slots) = &mut self.slots {
            let Some(at) = slots.iter().position(|&slot| slot == group) else { return false };
            slots.swap_remove(at);
        }
        self.budget -= group;
        true
    }
}

/// What a run keeps in each room: group offload gives each group, in call order, to the first room that takes it
/// (the donors before RAM). Returns, per room, the sizes of the groups it holds, in call order.
pub(super) fn run_keeps(groups: &[u64], rooms: &[Room]) -> Vec<Vec<u64>> {
    let mut rooms = rooms.to_vec();
    let mut held = vec![Vec::new(); rooms.len()];
    for &group in groups {
        if let Some(r) = rooms.iter_mut().position(|room| room.takes(group)) {
            held[r].push(group);
        }
    }
    held
}

/// One share per peer from what it holds; its groups' sizes where they are `exact`.
fn shares(peers: &[PeerDevice], held: &[Vec<u64>], exact: bool) -> Vec<PeerShare> {
    (peers.iter().zip(held))
        .map(|(peer, sizes)| PeerShare {
            peer: peer.name.clone(),
            groups: sizes.len(),
            bytes: sizes.iter().sum(),
            group_bytes: if exact { sizes.clone() } else { Vec::new() },
        })
        .collect()
}

/// Why a component holds what it holds on the peers.
fn peer_note(
    shares: &[PeerShare],
    peers: &[PeerDevice],
    total: usize,
    host_rates: &str,
    calls: u32,
    saving: Option<f64>,
) -> String {
    let held: Vec<String> = (shares.iter().zip(peers))
        .filter(|(share, _)| share.bytes > 0)
        .map(|(share, peer)| {
            format!(
                "{} of its {total} streamed groups ({}) live on {} between their uploads, copied at {}",
                share.groups,
                fs(share.bytes),
                peer.name,
                peer_rate(peer)
            )
        })
        .collect();
    let saves = saving.map(|s| format!(", which saves {s:.3} s per image")).unwrap_or_default();
    format!(
        "{} against {host_rates}, placed by cost with each group counted once per copy ({calls} an image){saves}",
        held.join("; ")
    )
}

/// A peer's cost per GB copied, and where its rate came from when runs measured it (`0.320 s per GB (measured:
/// one run's median, 13 copies)`); a declared rate is the one the caller gave, and says nothing more.
fn peer_rate(peer: &PeerDevice) -> String {
    match peer.source {
        LinkSource::Measured { .. } => format!("{:.3} s per GB ({})", peer.seconds_per_gb(), peer.source),
        _ => format!("{:.3} s per GB", peer.seconds_per_gb()),
    }
}

/// The peers' names, `cuda:1` or `cuda:1 and cuda:2`.
fn names(peers: &[PeerDevice]) -> String {
    let names: Vec<&str> = peers.iter().map(|peer| peer.name.as_str()).collect();
    join_and(&names)
}

#[cfg(test)]
mod tests {
    use super::{Room, run_keeps};

    fn budget(bytes: u64) -> Room {
        Room { budget: bytes, slots: None }
    }

    fn sizes(sizes: &[u64]) -> Room {
        Room { budget: sizes.iter().sum(), slots: Some(sizes.to_vec()) }
    }

    #[test]
    fn by_budgets_a_run_gives_each_group_to_the_first_room_with_space_in_call_order() {
        // A donor of 5 and RAM of 4: 3 to the donor, 2 to the donor, 4 to RAM, 1 to neither (both are full).
        assert_eq!(run_keeps(&[3, 2, 4, 1], &[budget(5), budget(4)]), vec![vec![3, 2], vec![4]]);
        // A group too large for the donor's room goes on to RAM, and a later small one still fits the donor.
        assert_eq!(run_keeps(&[4, 3, 1], &[budget(2), budget(4)]), vec![vec![1], vec![4]]);
        assert_eq!(run_keeps(&[4, 3, 1], &[]), Vec::<Vec<u64>>::new());
    }

    #[test]
    fn by_sizes_a_run_keeps_the_searchs_placement() {
        // The search put a 2 and a 3 on each donor. By budgets of 5 each, the two 2s fill the first and the 3s
        // overflow the second: a 3 is left. By sizes, each donor takes one of each.
        let groups = [2, 2, 3, 3];
        assert_eq!(run_keeps(&groups, &[budget(5), budget(5)]), vec![vec![2, 2], vec![3]]);
        assert_eq!(run_keeps(&groups, &[sizes(&[2, 3]), sizes(&[3, 2])]), vec![vec![2, 3], vec![2, 3]]);
        // A room takes no size it was not given, whatever its budget.
        assert_eq!(run_keeps(&[4, 1], &[Room { budget: 10, slots: Some(vec![1]) }]), vec![vec![1]]);
    }
}
