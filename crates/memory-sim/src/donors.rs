//! Donor cards and their links: a streamed model's groups held on simulated second cards, in host RAM or in the
//! checkpoint file, each reached over a link of its own, and a step run over a placement of them.
//!
//! The planner's [`DonorProblem`] places groups over donors by cost; this module builds that problem from
//! simulated hardware ([`DonorMachine::problem`]: the execution card's host link, pinned and pageable, a
//! [`PeerCard`] per second card with its [`SimLink`], the checkpoint file at a read rate) and runs a placement on
//! it ([`run_step`]): every peer card, in hard mode, allocates the groups it holds; then, in call order, the
//! execution card allocates each streamed group, copies it over its donor's link (the execution card's own ledger
//! prices host copies, pinned at the link rate and pageable at its pageable share; a peer's [`SimLink`] prices
//! the card-to-card copies), computes its share of the step and frees it. A placement that overfills a card fails
//! as it would on the device, and the step's simulated seconds can be set beside the plan's prediction.

use std::sync::Arc;
use std::time::Duration;

use offload_core::plan::{
    Donor, DonorBudget, DonorKind, DonorPlacement, DonorProblem, LinkSource, PeerDevice, StreamedGroup,
};
use offload_core::{DeviceLedger, DeviceMemory, Direction};

use crate::card::{CardSpec, Mode, SimCard};
use crate::error::SimError;

/// A device-to-device link between a peer card and the execution card.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimLink {
    /// The name to ask for (`nvlink`).
    pub name: &'static str,
    /// What it stands for, with the source of the figure.
    pub description: &'static str,
    /// Bytes per second each way.
    pub bytes_per_second: f64,
    /// Fixed cost of one copy.
    pub latency: Duration,
}

impl SimLink {
    /// Seconds one copy of `bytes` takes over the link.
    pub fn seconds(&self, bytes: u64) -> f64 {
        bytes as f64 / self.bytes_per_second + self.latency.as_secs_f64()
    }

    /// The link by name (case-insensitive), or an error listing [`LINKS`].
    pub fn parse(name: &str) -> Result<Self, SimError> {
        let lower = name.trim().to_ascii_lowercase();
        LINKS.iter().find(|link| link.name == lower).copied().ok_or_else(|| SimError::UnknownLink {
            name: name.trim().to_string(),
            accepted: LINKS.iter().map(|link| link.name).collect::<Vec<_>>().join(", "),
        })
    }
}

/// The links a peer card can be given, at the rates ComfyUI-MultiGPU's DisTorch published for FLUX1-dev Q8_0 on
/// RTX 3090s (seconds per step per GB streamed, turned into bytes per second): what a copy reached in a real
/// pipeline, not the bus's datasheet rate.
pub const LINKS: &[SimLink] = &[
    SimLink {
        name: "nvlink",
        description: "NVLink between two RTX 3090s: 0.02 s/it per GB streamed (DisTorch), 50 GB/s",
        bytes_per_second: 50e9,
        latency: Duration::from_micros(10),
    },
    SimLink {
        name: "pcie4x16",
        description: "a second card on PCIe 4.0 x16: DisTorch's 0.06 s/it per GB from RAM over that bus, 16.7 GB/s",
        bytes_per_second: 1e9 / 0.06,
        latency: Duration::from_micros(10),
    },
    SimLink {
        name: "pcie3x8",
        description: "a second RTX 3090 on PCIe 3.0 x8: 0.32 s/it per GB streamed (DisTorch), 3.1 GB/s",
        bytes_per_second: 1e9 / 0.32,
        latency: Duration::from_micros(10),
    },
];

/// A second card that holds groups for the execution card, and the link between them.
#[derive(Debug, Clone)]
pub struct PeerCard {
    /// Its name as a donor (`cuda:1`).
    pub name: String,
    /// The card, in hard mode: a placement that overfills it fails to allocate.
    pub card: Arc<SimCard>,
    /// The link its copies cross.
    pub link: SimLink,
}

impl PeerCard {
    /// A peer card from `CARD@LINK` (`24GB@nvlink`, `rtx4090@pcie3x8`): a card as [`CardSpec::parse`] reads it, in
    /// hard mode, over a link of [`LINKS`].
    pub fn parse(name: &str, label: &str) -> Result<Self, SimError> {
        let Some((card, link)) = label.rsplit_once('@') else {
            return Err(SimError::UnknownLink {
                name: format!("{label} (no @LINK)"),
                accepted: LINKS.iter().map(|link| link.name).collect::<Vec<_>>().join(", "),
            });
        };
        let spec = CardSpec::parse(card)?.with_mode(Mode::Hard);
        Ok(Self { name: name.into(), card: SimCard::new(spec), link: SimLink::parse(link)? })
    }

    /// This card as the planner's peer ([`Machine::peers`](offload_core::plan::Machine::peers)): its free
    /// memory, and its link's rate and latency, given (a datasheet figure).
    pub fn peer_device(&self) -> PeerDevice {
        PeerDevice::new(&self.name, self.card.available(), self.link.bytes_per_second, self.link.latency.as_secs_f64())
    }
}

/// The simulated hardware a streamed model's groups can be placed over.
#[derive(Debug, Clone)]
pub struct DonorMachine {
    /// The card that computes: its host link prices pinned and pageable copies.
    pub exec: Arc<SimCard>,
    /// Second cards, each over its own link.
    pub peers: Vec<PeerCard>,
    /// Host RAM the groups may fill, pinned and pageable together.
    pub host_bytes: u64,
    /// Of it, the most that may be pinned.
    pub pinned_bytes: u64,
    /// The checkpoint file's read rate, bytes per second; `None` where the weights are not in a file as uploaded.
    pub file_bytes_per_second: Option<f64>,
}

impl DonorMachine {
    /// The donors and budgets of this machine as the planner's problem for `groups`, with `flops` of compute per
    /// step on the execution card. Donors come in this order: each peer, pinned RAM, pageable RAM, the file.
    pub fn problem(&self, groups: Vec<StreamedGroup>, flops: f64) -> DonorProblem {
        let timing = self.exec.spec().timing;
        let latency = timing.link_latency.as_secs_f64();
        let mut donors = Vec::new();
        let mut budgets = Vec::new();
        for peer in &self.peers {
            budgets.push(DonorBudget::new(&format!("{} memory", peer.name), peer.card.available()));
            donors.push(
                Donor::new(&peer.name, DonorKind::Device, peer.link.bytes_per_second, peer.link.latency.as_secs_f64())
                    .drawing_on(budgets.len() - 1),
            );
        }
        budgets.push(DonorBudget::new("host RAM", self.host_bytes));
        let host = budgets.len() - 1;
        budgets.push(DonorBudget::new("pinning limit", self.pinned_bytes));
        let pinned = budgets.len() - 1;
        donors.push(
            Donor::new("pinned", DonorKind::PinnedRam, timing.link_bytes_per_second, latency)
                .drawing_on(host)
                .drawing_on(pinned),
        );
        donors.push(
            Donor::new("ram", DonorKind::PageableRam, timing.link_bytes_per_second * timing.pageable_fraction, latency)
                .drawing_on(host),
        );
        if let Some(rate) = self.file_bytes_per_second {
            donors.push(Donor::new("file", DonorKind::File, rate, latency).with_source(LinkSource::Given));
        }
        DonorProblem { compute_seconds: timing.compute_seconds(flops), groups, donors, budgets }
    }
}

/// What a step over a placement took on the simulated hardware.
#[derive(Debug, Clone, PartialEq)]
pub struct SimulatedStep {
    /// Simulated seconds: copies plus compute, nothing overlapping (the cost model the plan predicts).
    pub seconds: f64,
    /// Of them, seconds on the links.
    pub copy_seconds: f64,
    /// Of them, seconds computing.
    pub compute_seconds: f64,
    /// Bytes each donor streamed, in the problem's donor order.
    pub bytes_per_donor: Vec<u64>,
    /// The most the execution card held during the step, its resident bytes before it included.
    pub exec_peak: u64,
}

/// Runs one step of `placement` over `machine` (the problem must be `machine.problem(..)`'s), `flops` of compute
/// spread over the groups by their bytes. Peer cards allocate the groups they hold first (a placement that
/// overfills one is [`SimError::Placement`]); the groups they held are freed again at the end.
pub fn run_step(
    machine: &DonorMachine,
    problem: &DonorProblem,
    placement: &DonorPlacement,
    flops: f64,
) -> Result<SimulatedStep, SimError> {
    let misplaced = |problem: String| SimError::Placement { problem };
    if placement.donor_of.len() != problem.groups.len() {
        return Err(misplaced(format!(
            "the placement has {} groups and the problem {}; place the problem's groups",
            placement.donor_of.len(),
            problem.groups.len()
        )));
    }
    let mut held: Vec<(usize, u64)> = Vec::new();
    let release = |held: &[(usize, u64)]| {
        for (peer, bytes) in held {
            machine.peers[*peer].card.free(*bytes);
        }
    };
    for (group, &donor) in problem.groups.iter().zip(&placement.donor_of) {
        if donor < machine.peers.len() {
            if let Err(error) = machine.peers[donor].card.allocate(group.bytes) {
                release(&held);
                return Err(misplaced(format!("{} cannot hold {}: {error}", machine.peers[donor].name, group.name)));
            }
            held.push((donor, group.bytes));
        }
    }
    let before = machine.exec.stats();
    let mut peer_seconds = 0.0;
    let mut bytes_per_donor = vec![0u64; problem.donors.len()];
    let total: u64 = problem.groups.iter().map(|g| g.bytes).sum();
    let mut peak = machine.exec.allocated();
    let result = (|| {
        for (group, &donor) in problem.groups.iter().zip(&placement.donor_of) {
            machine.exec.allocate(group.bytes).map_err(|error| misplaced(format!("{}: {error}", group.name)))?;
            peak = peak.max(machine.exec.allocated());
            let kind = problem.donors.get(donor).map(|d| d.kind);
            let copied = match kind {
                Some(DonorKind::Device) => {
                    peer_seconds += machine.peers[donor].link.seconds(group.bytes);
                    Ok(())
                }
                Some(DonorKind::PinnedRam) => machine.exec.transfer_pinned(group.bytes),
                Some(DonorKind::PageableRam) => machine.exec.transfer(group.bytes, Direction::HostToDevice),
                Some(DonorKind::File) => {
                    // memory-sim has no disk: the file is read at its given rate.
                    peer_seconds += problem.donors[donor].seconds(group.bytes);
                    Ok(())
                }
                None => return Err(misplaced(format!("{} names donor #{donor}, which does not exist", group.name))),
            };
            copied.map_err(|error| misplaced(format!("{}: {error}", group.name)))?;
            bytes_per_donor[donor] += group.bytes;
            machine.exec.compute(flops * group.bytes as f64 / total.max(1) as f64);
            machine.exec.free(group.bytes);
        }
        Ok(())
    })();
    release(&held);
    result?;
    if problem.groups.is_empty() {
        machine.exec.compute(flops);
    }
    let after = machine.exec.stats();
    let copy_seconds = after.transfer_seconds - before.transfer_seconds + peer_seconds;
    let compute_seconds = after.compute_seconds - before.compute_seconds;
    Ok(SimulatedStep {
        seconds: copy_seconds + compute_seconds,
        copy_seconds,
        compute_seconds,
        bytes_per_donor,
        exec_peak: peak,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1 << 30;

    /// Z-Image-Turbo's 30 main transformer layers at real size, on a 24 GB card that keeps none of them, beside
    /// a second 24 GB card over NVLink and another over PCIe 3.0 x8, with 64 GB of RAM.
    fn machine(peers: &[(&str, &str)], host: u64) -> DonorMachine {
        let exec =
            SimCard::new(CardSpec::parse("24GB").unwrap().with_mode(Mode::Hard).with_pageable_fraction(0.5).unwrap());
        DonorMachine {
            exec,
            peers: peers.iter().map(|(name, label)| PeerCard::parse(name, label).unwrap()).collect(),
            host_bytes: host,
            pinned_bytes: host / 2,
            file_bytes_per_second: Some(2e9),
        }
    }

    fn layers() -> Vec<StreamedGroup> {
        crate::profile::z_image_turbo::transformer_blocks()
            .into_iter()
            .enumerate()
            .map(|(i, bytes)| StreamedGroup::new(&format!("layers.{i}"), bytes))
            .collect()
    }

    #[test]
    fn the_simulated_step_is_within_five_percent_of_the_plan() {
        for (peers, host) in [
            (vec![("cuda:1", "24GB@nvlink")], 4 * GB),
            (vec![("cuda:1", "8GB@pcie3x8"), ("cuda:2", "4GB@nvlink")], 2 * GB),
            (vec![], 6 * GB),
            (vec![("cuda:1", "24GB@pcie3x8")], 64 * GB),
        ] {
            let machine = machine(&peers, host);
            let flops = 8e12;
            let problem = machine.problem(layers(), flops);
            let placement = problem.place().unwrap();
            let step = run_step(&machine, &problem, &placement, flops).unwrap();
            let gap = (step.seconds - placement.step_seconds).abs() / placement.step_seconds;
            assert!(
                gap < 0.05,
                "simulated {} s against predicted {} s for {peers:?}",
                step.seconds,
                placement.step_seconds
            );
            let streamed: u64 = step.bytes_per_donor.iter().sum();
            assert_eq!(streamed, layers().iter().map(|g| g.bytes).sum::<u64>());
            for peer in &machine.peers {
                assert_eq!(peer.card.allocated(), 0, "the step frees what the peers held");
            }
        }
    }

    #[test]
    fn a_card_over_nvlink_is_filled_before_ram_and_one_over_pcie3_after_it() {
        let machine = machine(&[("cuda:1", "4GB@nvlink"), ("cuda:2", "24GB@pcie3x8")], 4 * GB);
        let problem = machine.problem(layers(), 8e12);
        let placement = problem.place().unwrap();
        let bytes = |donor| placement.bytes_from(&problem, donor);
        assert!(bytes(0) > 3 * GB, "NVLink first: {}", bytes(0));
        assert!(bytes(2) + bytes(3) > 3 * GB, "RAM next: {} pinned, {} pageable", bytes(2), bytes(3));
        assert!(bytes(1) > 0 && bytes(4) == 0, "the PCIe 3.0 card (3.1 GB/s) before the file (2 GB/s)");
    }

    #[test]
    fn a_placement_that_overfills_a_peer_fails_there_and_frees_what_it_took() {
        let machine = machine(&[("cuda:1", "4GB@nvlink")], 4 * GB);
        let problem = machine.problem(layers(), 8e12);
        let all_on_the_peer = DonorPlacement { donor_of: vec![0; problem.groups.len()], ..problem.place().unwrap() };
        let err = run_step(&machine, &problem, &all_on_the_peer, 8e12).unwrap_err();
        assert!(matches!(err, SimError::Placement { .. }), "{err}");
        assert!(err.to_string().contains("cuda:1 cannot hold"), "{err}");
        assert_eq!(machine.peers[0].card.allocated(), 0);
    }

    #[test]
    fn links_and_peers_are_read_by_name_and_a_wrong_one_lists_the_right_ones() {
        assert_eq!(SimLink::parse("NVLink").unwrap().bytes_per_second, 50e9);
        let err = SimLink::parse("infiniband").unwrap_err().to_string();
        assert!(err.contains("nvlink, pcie4x16, pcie3x8"), "{err}");
        assert!(PeerCard::parse("cuda:1", "24GB").unwrap_err().to_string().contains("no @LINK"));
        assert_eq!(PeerCard::parse("cuda:1", "rtx4090@pcie4x16").unwrap().card.spec().label, "rtx4090");
    }
}
