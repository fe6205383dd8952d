//! The command line's `--donor` (a module of the binary, `main.rs`): a further device whose memory holds streamed
//! groups between their uploads, a second simulated card on the CPU or a second real device beside a real one,
//! opened and priced before the weights load, handed to the components that stream, and reported after the run.

use anyhow::Context;
use group_offload::OffloadDevice;
use group_offload::config::PeerDonor;
use memory_sim::{SimCard, SimLink};
use offload_core::plan::{PeerDevice, PeerRun, ProfileStore};
use offload_core::{DeviceMemory, DeviceName, format_rate, format_size};
use pipeline_zimage::pipeline::{DeviceMap, ZImagePipeline};

use crate::{ArgumentError, FurtherCards, Generate, REAL_KINDS, card_devices, further_real_device, real_execution};

/// The bytes of the probe a real donor's copies are timed with where nothing else prices them: 64 MiB (at most a
/// quarter of either device's free memory), large enough that a GPU link's rate shows through its fixed costs.
const PROBE_BYTES: u64 = 64 << 20;

/// The host's probe copies, to compare a donor with: as many as a donor's (`PeerDonor::PROBE_COPIES`).
const PROBE_COPIES: usize = PeerDonor::PROBE_COPIES;

/// A `--donor` as the run holds it: opened, priced, and what the components that stream are given.
pub(crate) struct Donor {
    /// What the components that stream are given: the donor's device object, its free memory as the budget, and
    /// its link's rate.
    pub donor: PeerDonor,
    /// The donor as the planner's peer, its rate's source with it (given, measured by earlier runs, timed now).
    pub peer: PeerDevice,
    /// How its copies are priced, as the line that says so reads after "its copies ": `cross NVLink ..`, `at 1.10
    /// GB/s (timed now: ..)`.
    pub priced: String,
    /// Its link in a word: the link's name (`nvlink`), or `measured` and `timed now` for a rate measured.
    pub label: &'static str,
    /// The rate of the host's pageable copies onto the execution device, bytes per second: a donor no faster is
    /// left unused without the planner, as the planner would leave it.
    pub host_rate: Option<f64>,
}

impl Donor {
    /// The donor's device object.
    pub fn device(&self) -> &OffloadDevice {
        &self.donor.device
    }
}

/// `--donor DEVICE[@LINK]`, checked against the run's devices. On the CPU (`real` false) DEVICE is a further
/// `--card` (never the first, which executes) and LINK, which it needs, a link memory-sim knows. Beside a real
/// execution device DEVICE is another real device by name (`cuda:1`, `wgpu:1`) and LINK is optional: without it
/// the copies' rate is measured.
pub(crate) fn parse_donor(
    text: &str,
    devices: &[DeviceName],
    real: bool,
) -> Result<(DeviceName, Option<SimLink>), ArgumentError> {
    let wrong = |reason: String| ArgumentError::Donor { given: text.to_string(), reason };
    let (device, link) = match text.split_once('@') {
        Some((device, link)) => (device, Some(link)),
        None if real => (text, None),
        None => return Err(wrong("give DEVICE@LINK, a further --card and its link: cuda:1@nvlink".into())),
    };
    let device = DeviceName::parse(device.trim()).map_err(|error| wrong(format!("{error}")))?;
    let exec = devices.first().cloned().unwrap_or_else(DeviceName::cpu);
    if real {
        if !REAL_KINDS.contains(&device.kind()) || device == exec {
            return Err(wrong(format!(
                "name another device of this machine than the execution device {exec} (cuda:N, wgpu:N), with an \
                 optional link (wgpu:1@pcie4x16) where its rate should not be measured"
            )));
        }
    } else if !devices.iter().skip(1).any(|further| *further == device) {
        let further: Vec<&str> = devices.iter().skip(1).map(DeviceName::as_str).collect();
        return Err(wrong(if further.is_empty() {
            "no further card is given: add a second --card (the donor, cuda:1) beside the execution card, with \
             --device cpu"
                .to_string()
        } else {
            format!("{device} is not a further card; the further cards are {}", further.join(", "))
        }));
    }
    let link = link.map(|link| SimLink::parse(link).map_err(|error| wrong(format!("{error}")))).transpose()?;
    Ok((device, link))
}

/// Checks every `--donor` before anything opens: each as [`parse_donor`] reads it, and no device twice.
pub(crate) fn check_donors(args: &Generate) -> Result<(), ArgumentError> {
    let devices = card_devices(args)?;
    let mut seen: Vec<DeviceName> = Vec::new();
    for text in &args.donor {
        let (device, _) = parse_donor(text, &devices, real_execution(args))?;
        if seen.contains(&device) {
            return Err(ArgumentError::Donor {
                given: text.clone(),
                reason: format!("{device} is given as a donor twice; give each further device once"),
            });
        }
        seen.push(device);
    }
    Ok(())
}

/// Each `--donor`, opened and priced before the weights load. A further card is priced at its declared link and
/// the host's copies at the execution card's pageable rate. A real device is the device map's object where the map
/// places a component there, else opened now with the execution device's page policy; its copies are priced at
/// the link given, else at the rate earlier runs stored for the pair in `store`, else by a probe timed now
/// ([`OffloadDevice::time_copies_from`]); without the planner (`planner` false) the host's pageable copies are
/// timed the same way, to compare.
pub(crate) fn price_donors(
    args: &Generate,
    placement: &OffloadDevice,
    map: &DeviceMap,
    others: &FurtherCards,
    store: &ProfileStore,
    planner: bool,
) -> anyhow::Result<Vec<Donor>> {
    let devices = card_devices(args)?;
    let real = real_execution(args);
    let mut donors = Vec::new();
    for text in &args.donor {
        let (name, link) = parse_donor(text, &devices, real)?;
        donors.push(if real {
            price_real(&name, link, placement, map, store, planner)?
        } else {
            // `parse_donor` asks a further card for its link; this says so again rather than assume it.
            let link = link.with_context(|| format!("--donor {text}: give a further card's link, cuda:1@nvlink"))?;
            price_card(text, &name, link, placement, others)?
        });
    }
    Ok(donors)
}

/// A further simulated card as a donor: its free memory, its declared link.
fn price_card(
    text: &str,
    name: &DeviceName,
    link: SimLink,
    placement: &OffloadDevice,
    others: &FurtherCards,
) -> anyhow::Result<Donor> {
    let (card, device) = (others.iter())
        .find(|(_, other)| other.name() == name)
        .cloned()
        .with_context(|| format!("--donor {text}: the card {name} was not opened"))?;
    let donor = PeerDonor {
        device,
        budget: card.available(),
        bytes_per_second: link.bytes_per_second,
        latency_seconds: link.latency.as_secs_f64(),
        groups: None,
    };
    let host_rate = placement.account::<SimCard>().map(|exec| exec.spec().timing.pageable_bytes_per_second());
    let priced = format!("cross {}", link.description);
    Ok(Donor { peer: donor.peer_device(), donor, priced, label: link.name, host_rate })
}

/// A second real device as a donor: its free memory now, its copies priced as [`price_donors`] says.
fn price_real(
    name: &DeviceName,
    link: Option<SimLink>,
    placement: &OffloadDevice,
    map: &DeviceMap,
    store: &ProfileStore,
    planner: bool,
) -> anyhow::Result<Donor> {
    let device = match map.components.iter().find(|(_, placed)| placed.name() == name) {
        Some((_, placed)) => placed.clone(),
        None => further_real_device(name, placement)?,
    };
    let free = device.readings().available();
    let probe_bytes = PROBE_BYTES.min(free / 4).min(placement.readings().available() / 4).max(4);
    let exec = placement.name().as_str();
    let (peer, donor, priced, label) = match link {
        Some(link) => {
            let mut donor = PeerDonor::new(device, free, link.bytes_per_second);
            donor.latency_seconds = link.latency.as_secs_f64();
            (donor.peer_device(), donor, format!("cross {} (given)", link.description), link.name)
        }
        None => {
            let earlier = store.measured_peer(exec, name.as_str())?;
            let (donor, peer) = PeerDonor::timed(placement, device, earlier, probe_bytes)?;
            let priced = match earlier {
                Some(_) => {
                    let path = store.peer_path(exec, name.as_str());
                    format!("at {} ({}, {})", format_rate(peer.bytes_per_second), peer.source, path.display())
                }
                None => format!(
                    "at {} (timed now: {} copies of {} from {name} onto {exec}; the run's copies are kept for later \
                     runs)",
                    format_rate(peer.bytes_per_second),
                    PeerDonor::PROBE_COPIES,
                    format_size(probe_bytes)
                ),
            };
            (peer, donor, priced, if earlier.is_some() { "measured" } else { "timed now" })
        }
    };
    let host_rate = if planner {
        None
    } else {
        let host = placement.time_copies_from(&OffloadDevice::host_only(), probe_bytes, PROBE_COPIES)?;
        Some(host.median)
    };
    Ok(Donor { donor, peer, priced, label, host_rate })
}

/// Hands a priced donor to the components that stream, after the weights load and before any offload is applied
/// (the groups are placed as they are split). Under the planner the donor is a peer of the plan's machine and the
/// donor of every component the plan streams: the plan places each one's groups over it, RAM and the file by
/// cost, and the donor holds at most the plan's share. Without the planner (`--offload group`) it is the
/// transformer's donor, up to its memory, where its copies are faster than the host's pageable copies; a slower
/// one (a second card on PCIe 3.0 x8) is left unused, as the planner would leave it. Returns whether it is used.
pub(crate) fn set_donor(pipeline: &mut ZImagePipeline, donor: &Donor, planner: bool) -> anyhow::Result<bool> {
    let name = donor.device().name();
    let free = format_size(donor.donor.budget);
    if planner {
        pipeline.text_encoder_mut().add_donor(donor.donor.clone())?;
        pipeline.transformer_mut().add_donor(donor.donor.clone())?;
        println!(
            "donor: {name} ({free} free) can hold streamed groups between their uploads; its copies {}; the plan \
             places each component's groups over it, RAM and the checkpoint file by cost",
            donor.priced
        );
        return Ok(true);
    }
    if let Some(host) = donor.host_rate.filter(|host| *host >= donor.donor.bytes_per_second) {
        println!(
            "donor: {name} is not used: its link ({}, {}) is no faster than the host's pageable copies to {} ({}); \
             a group there would cost more than one in RAM",
            donor.label,
            format_rate(donor.donor.bytes_per_second),
            pipeline.placement().name(),
            format_rate(host)
        );
        return Ok(false);
    }
    pipeline.transformer_mut().add_donor(donor.donor.clone())?;
    println!(
        "donor: {name} ({free} free) holds the transformer's streamed groups between their uploads; its copies {}",
        donor.priced
    );
    Ok(true)
}

/// Prints, for each donor that held some of the transformer's streamed groups or that its uploads were copied
/// from, what it held and the bytes of the transformer's uploads copied from it (the record's rows that name it).
pub(crate) fn print_donors(pipeline: &ZImagePipeline) {
    let Some(offload) = pipeline.transformer().group_offload() else { return };
    let moves = pipeline.manager().offload_record().group_moves().events();
    for (donor, held, groups) in offload.donor_holdings() {
        let copied: u64 = (moves.iter())
            .filter(|e| e.action == offload_core::Action::Onload && e.id.starts_with("transformer/"))
            .filter(|e| e.from_peer.as_deref() == Some(donor.as_str()))
            .map(|e| e.bytes)
            .sum();
        if held > 0 || copied > 0 {
            println!(
                "donor: {} of the transformer's groups ({groups}) held on {donor}, {} of its copies to the device \
                 from it",
                format_size(held),
                format_size(copied)
            );
        }
    }
}

/// Keeps the rate each real donor's copies onto the execution device reached in this run (its peer meter) in
/// `store`, for the next plan on the pair, and says where.
pub(crate) fn record_peer_rates(pipeline: &ZImagePipeline, store: &ProfileStore) -> anyhow::Result<()> {
    let exec = pipeline.placement().name().as_str();
    for (peer, rate) in pipeline.placement().peer_rates() {
        let Some(run) = PeerRun::from_rate(Some(rate)) else { continue };
        let measured = store.record_peer(exec, peer.as_str(), run)?;
        println!(
            "peer link figures for later plans on {exec}: copies from {peer} at {} ({} run(s), {})",
            format_rate(measured.median),
            measured.runs,
            store.peer_path(exec, peer.as_str()).display()
        );
    }
    Ok(())
}

/// The pool of each real donor that is not already shown (the execution device's, a device the map placed a
/// component on), since it opened.
pub(crate) fn real_donor_pools<'a>(
    donors: &'a [Donor],
    shown: &[&DeviceName],
) -> Vec<(&'a DeviceName, std::sync::Arc<group_offload::device::PoolReadings>)> {
    (donors.iter())
        .filter(|donor| !shown.contains(&donor.device().name()))
        .filter_map(|donor| Some((donor.device().name(), donor.device().pool_readings()?)))
        .collect()
}
