//! Budgets: how many bytes stay resident, how many are pinned, and when everything is pinned and nothing kept.
//!
//! Each is a pure function of measured numbers, so the planner's choices can be checked by hand. Where DDO uses
//! fixed VRAM headroom tiers (2 to 3 GB, or 15% of the card), these budgets leave room for the workload's own
//! activation estimate plus a margin ([`activation_headroom`]).

use crate::plan::host::HostMemory;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// The smallest margin added to an activation estimate: 256 MiB, for allocator rounding and fragmentation.
pub const MIN_ACTIVATION_MARGIN: u64 = 256 * MIB;

/// The margin added to an activation estimate: a quarter of the estimate, at least [`MIN_ACTIVATION_MARGIN`].
///
/// The quarter covers what an estimate leaves out (norm statistics, temporary casts, a backend's workspace).
/// It is a choice, not a measurement; a calibrated profile replaces it with the measured peak.
///
/// ```
/// use offload_core::plan::budget::activation_margin;
/// assert_eq!(activation_margin(0), 256 << 20);
/// assert_eq!(activation_margin(4 << 30), 1 << 30);
/// ```
pub fn activation_margin(activation: u64) -> u64 {
    (activation / 4).max(MIN_ACTIVATION_MARGIN)
}

/// Bytes kept free on the device while a component runs: the `reserve` setting when given (it replaces the
/// estimate, as the manager's reserve does), otherwise the activation estimate plus [`activation_margin`].
///
/// ```
/// use offload_core::plan::budget::activation_headroom;
/// assert_eq!(activation_headroom(1 << 30, None), (1 << 30) + (256 << 20));
/// assert_eq!(activation_headroom(1 << 30, Some(3 << 30)), 3 << 30);
/// ```
pub fn activation_headroom(activation: u64, reserve: Option<u64>) -> u64 {
    reserve.unwrap_or_else(|| activation.saturating_add(activation_margin(activation)))
}

/// Device bytes left for weights once the headroom is set aside.
pub fn weight_room(device_available: u64, headroom: u64) -> u64 {
    device_available.saturating_sub(headroom)
}

/// Device bytes the streamed groups occupy at once: the group being computed plus `depth` prefetched ones, or
/// the group alone without prefetch (group offload's ring bound).
///
/// ```
/// use offload_core::plan::budget::streaming_window;
/// assert_eq!(streaming_window(100, true, 2), 300);
/// assert_eq!(streaming_window(100, false, 2), 100);
/// ```
pub fn streaming_window(largest_group: u64, prefetch: bool, depth: usize) -> u64 {
    let in_flight = if prefetch { 1 + depth as u64 } else { 1 };
    largest_group.saturating_mul(in_flight)
}

/// The resident budget: how many bytes of a streamed model's blocks stay on the device.
///
/// What is left of the weight room once the bytes outside the blocks and the streaming window are placed,
/// capped at the blocks' total: `min(blocks_total, room - outside - window)`, zero when nothing is left.
///
/// ```
/// use offload_core::plan::budget::resident_budget;
/// // 6 GiB of room, 1 GiB outside the blocks, a 1 GiB window: 4 GiB of blocks stay.
/// assert_eq!(resident_budget(6 << 30, 1 << 30, 1 << 30, 10 << 30), 4 << 30);
/// // Everything fits: the budget is the blocks' total.
/// assert_eq!(resident_budget(20 << 30, 1 << 30, 1 << 30, 10 << 30), 10 << 30);
/// // The window does not fit: nothing stays.
/// assert_eq!(resident_budget(1 << 30, 1 << 30, 1 << 30, 10 << 30), 0);
/// ```
pub fn resident_budget(weight_room: u64, outside_bytes: u64, window_bytes: u64, blocks_total: u64) -> u64 {
    weight_room.saturating_sub(outside_bytes).saturating_sub(window_bytes).min(blocks_total)
}

/// Host bytes left to the rest of the machine (the OS, the page cache, the program's own data): an eighth of
/// installed RAM, at least 2 GiB. DDO keeps a fixed 6 to 8 GB; a fraction scales from 16 GB laptops to servers.
///
/// ```
/// use offload_core::plan::budget::host_margin;
/// assert_eq!(host_margin(8 << 30), 2 << 30);
/// assert_eq!(host_margin(64 << 30), 8 << 30);
/// ```
pub fn host_margin(host_total: u64) -> u64 {
    (host_total / 8).max(2 * GIB)
}

/// Host bytes the planner may fill with host copies: available RAM less [`host_margin`].
pub fn usable_host(host: HostMemory) -> u64 {
    host.available.saturating_sub(host_margin(host.total))
}

/// The pinned budget: how many of the `wanted` bytes of host copies are pinned (page-locked).
///
/// Pinned pages cannot be swapped, so pinning must leave room in RAM for the host copies that are not pinned:
/// `min(wanted, usable - (host_copies - wanted))`, zero when the copies alone overflow the usable RAM. When
/// every host copy fits, everything wanted is pinned. (DDO skips pinning entirely in that case; pinning part of
/// the copies, group by group, still speeds up those groups.)
///
/// ```
/// use offload_core::plan::budget::pinned_budget;
/// // 20 GiB usable, 15 GiB of host copies of which 10 GiB are worth pinning: all 10.
/// assert_eq!(pinned_budget(20 << 30, 15 << 30, 10 << 30), 10 << 30);
/// // 12 GiB usable: the 5 GiB not pinned stay pageable, 7 GiB can be pinned.
/// assert_eq!(pinned_budget(12 << 30, 15 << 30, 10 << 30), 7 << 30);
/// // 4 GiB usable: the unpinned copies alone overflow it, nothing is pinned.
/// assert_eq!(pinned_budget(4 << 30, 15 << 30, 10 << 30), 0);
/// ```
pub fn pinned_budget(usable_host: u64, host_copies: u64, wanted: u64) -> u64 {
    let wanted = wanted.min(host_copies);
    let unpinned = host_copies - wanted;
    usable_host.saturating_sub(unpinned).min(wanted)
}

/// DDO's default threshold for [`full_pin_zero_resident`]: a model at least 4 times the card.
pub const FULL_PIN_RATIO: f64 = 4.0;

/// The full-pin rule: when a model is `ratio` times the card or more and its whole host copy fits in usable
/// RAM, pin all of it and keep nothing resident, so the card's memory goes to activations rather than to a few
/// resident blocks that save a small share of the streaming.
///
/// A ratio of 0 (or less) disables the rule. At 4x a resident budget could keep at most a quarter of the model,
/// while every byte of it is a byte activations cannot use.
///
/// ```
/// use offload_core::plan::budget::{FULL_PIN_RATIO, full_pin_zero_resident};
/// let card = 8 << 30;
/// assert!(full_pin_zero_resident(32 << 30, card, 40 << 30, FULL_PIN_RATIO));
/// assert!(!full_pin_zero_resident(31 << 30, card, 40 << 30, FULL_PIN_RATIO)); // below 4x
/// assert!(!full_pin_zero_resident(32 << 30, card, 30 << 30, FULL_PIN_RATIO)); // RAM too small
/// assert!(!full_pin_zero_resident(32 << 30, card, 40 << 30, 0.0)); // disabled
/// ```
pub fn full_pin_zero_resident(model_bytes: u64, device_total: u64, usable_host: u64, ratio: f64) -> bool {
    ratio > 0.0 && usable_host >= model_bytes && model_bytes as f64 >= ratio * device_total as f64
}

/// Headroom a calibrated budget leaves below the device's available memory: a twentieth of it, at least
/// 256 MiB, for run-to-run variation of the measured peak.
pub fn calibration_headroom(device_available: u64) -> u64 {
    (device_available / 20).max(MIN_ACTIVATION_MARGIN)
}

/// The resident budget a calibration run recommends: the budget it ran with plus what its measured peak left
/// free, less [`calibration_headroom`]: `resident_used + available - peak - headroom`, never negative.
///
/// ```
/// use offload_core::plan::budget::{calibration_headroom, recommend_resident_budget};
/// let available = 10 << 30;
/// // A zero-resident run peaked at 3 GiB: 7 GiB are free, less the 512 MiB headroom.
/// assert_eq!(recommend_resident_budget(available, 3 << 30, 0), (7 << 30) - calibration_headroom(available));
/// // A run that overshot recommends less than it used.
/// assert!(recommend_resident_budget(available, 10 << 30, 2 << 30) < 2 << 30);
/// ```
pub fn recommend_resident_budget(device_available: u64, measured_peak: u64, resident_used: u64) -> u64 {
    (resident_used.saturating_add(device_available))
        .saturating_sub(measured_peak.saturating_add(calibration_headroom(device_available)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_pin_threshold_is_inclusive_at_four_times_the_card() {
        let card = 8_000_000_000u64;
        assert!(full_pin_zero_resident(32_000_000_000, card, u64::MAX, FULL_PIN_RATIO));
        assert!(!full_pin_zero_resident(31_999_999_999, card, u64::MAX, FULL_PIN_RATIO));
        // Another threshold moves the boundary.
        assert!(full_pin_zero_resident(16_000_000_000, card, u64::MAX, 2.0));
        assert!(!full_pin_zero_resident(15_999_999_999, card, u64::MAX, 2.0));
        // Z-Image-Turbo's transformer (11.46 GiB) on an 8 GB card is 1.5x: the rule does not apply.
        assert!(!full_pin_zero_resident(12_309_817_472, card, u64::MAX, FULL_PIN_RATIO));
    }

    #[test]
    fn budgets_never_underflow() {
        assert_eq!(resident_budget(0, 10, 10, 10), 0);
        assert_eq!(weight_room(1, 10), 0);
        assert_eq!(pinned_budget(0, 0, 10), 0);
        assert_eq!(pinned_budget(100, 5, 10), 5);
        assert_eq!(usable_host(HostMemory::new(1 << 30, 1 << 30)), 0);
        assert_eq!(recommend_resident_budget(0, u64::MAX, u64::MAX), 0);
        assert_eq!(activation_headroom(u64::MAX, None), u64::MAX);
    }

    #[test]
    fn host_margin_scales_with_installed_ram() {
        assert_eq!(host_margin(16_000_000_000), 2 * GIB);
        assert_eq!(host_margin(32_000_000_000), 4_000_000_000);
        assert_eq!(host_margin(64_000_000_000), 8_000_000_000);
        assert_eq!(usable_host(HostMemory::new(32_000_000_000, 28_800_000_000)), 24_800_000_000);
    }
}
