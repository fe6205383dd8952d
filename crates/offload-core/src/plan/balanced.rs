//! Whole components placed over several devices by size: the `balanced` device map, diffusers' rule
//! (`device_map="balanced"`, `_assign_components_to_devices` in `pipeline_loading_utils.py`), written as a pure
//! function of the components' sizes and the devices' free bytes.
//!
//! The rule: the components are taken largest first (equal sizes in the order given) and dealt to the devices in a
//! back-and-forth cycle (with devices 0, 1, 2: 0, 1, 2, 2, 1, 0, 0, 1, ..), so the two largest land on different
//! devices and the next ones fill the devices the large ones left room on. A component larger than what its turn's
//! device has left goes to the host instead and the turn does not move on. diffusers keeps only the last of the
//! components it sends to the host (its mapping assigns a new list each time); here every one is kept.

use std::fmt;

/// Where [`balance`] put one component.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// The component's name, as given.
    pub component: String,
    /// Its bytes, as given.
    pub bytes: u64,
    /// The index of the device it runs on, in the order the devices were given; `None`: on the host, since it did
    /// not fit the device whose turn it was.
    pub device: Option<usize>,
}

/// The balanced placement: one [`Assignment`] per component, largest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Balanced {
    /// The components in the order they were placed.
    pub assignments: Vec<Assignment>,
    /// Each device's free bytes left after the placement, in the order the devices were given.
    pub left: Vec<u64>,
}

impl Balanced {
    /// The device index `component` was given (`Some(None)`: the host); `None` for a name not placed.
    pub fn device_of(&self, component: &str) -> Option<Option<usize>> {
        self.assignments.iter().find(|a| a.component == component).map(|a| a.device)
    }
}

impl fmt::Display for Balanced {
    /// One line per component: `transformer (11.46 GiB) -> device 0`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for a in &self.assignments {
            let size = crate::format_size(a.bytes);
            match a.device {
                Some(device) => writeln!(f, "{} ({size}) -> device {device}", a.component)?,
                None => writeln!(f, "{} ({size}) -> host (larger than its turn's device had left)", a.component)?,
            }
        }
        Ok(())
    }
}

/// Places `components` (name, bytes) over devices with `free` bytes each (in order; the first is the one a tie
/// starts at) by the balanced rule (this module's page). With no device, every component goes to the host.
pub fn balance(components: &[(&str, u64)], free: &[u64]) -> Balanced {
    let mut order: Vec<&(&str, u64)> = components.iter().collect();
    // A stable sort: equal sizes keep the order they were given in.
    order.sort_by_key(|&&(_, bytes)| std::cmp::Reverse(bytes));
    let mut left = free.to_vec();
    let cycle: Vec<usize> = (0..free.len()).chain((0..free.len()).rev()).collect();
    let mut turn = 0;
    let assignments = order
        .into_iter()
        .map(|&(component, bytes)| {
            let device = cycle.get(turn % cycle.len().max(1)).copied().filter(|&device| bytes <= left[device]);
            if let Some(device) = device {
                left[device] -= bytes;
                turn += 1;
            }
            Assignment { component: component.to_string(), bytes, device }
        })
        .collect();
    Balanced { assignments, left }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1_000_000_000;

    fn devices(balanced: &Balanced) -> Vec<(String, Option<usize>)> {
        balanced.assignments.iter().map(|a| (a.component.clone(), a.device)).collect()
    }

    fn placed(pairs: &[(&str, Option<usize>)]) -> Vec<(String, Option<usize>)> {
        pairs.iter().map(|(name, device)| (name.to_string(), *device)).collect()
    }

    /// Z-Image's three components on two 16 GB cards: the transformer on the first, the text encoder on the second,
    /// and the VAE on the second too (the cycle turns back: 0, 1, 1, 0).
    #[test]
    fn the_largest_components_go_to_different_devices_and_the_cycle_turns_back() {
        let components = [("text_encoder", 8 * GB), ("transformer", 12 * GB), ("vae", GB / 4)];
        let balanced = balance(&components, &[16 * GB, 16 * GB]);
        let expected = [("transformer", Some(0)), ("text_encoder", Some(1)), ("vae", Some(1))];
        assert_eq!(devices(&balanced), placed(&expected));
        assert_eq!(balanced.left, vec![4 * GB, 16 * GB - 8 * GB - GB / 4]);
        assert_eq!(balanced.device_of("vae"), Some(Some(1)));
        assert_eq!(balanced.device_of("unet"), None);
    }

    /// Three devices and five components: 0, 1, 2, 2, 1.
    #[test]
    fn the_cycle_runs_forward_then_back() {
        let components = [("a", 50), ("b", 40), ("c", 30), ("d", 20), ("e", 10)];
        let balanced = balance(&components, &[100, 100, 100]);
        let expected = [("a", Some(0)), ("b", Some(1)), ("c", Some(2)), ("d", Some(2)), ("e", Some(1))];
        assert_eq!(devices(&balanced), placed(&expected));
    }

    /// A component larger than its turn's device's room goes to the host and the turn stays: the next component
    /// takes that device. Every component sent to the host is kept (diffusers keeps only the last).
    #[test]
    fn a_component_that_does_not_fit_its_turn_goes_to_the_host_and_the_turn_stays() {
        let components = [("huge", 30), ("big", 20), ("mid", 9), ("small", 5)];
        let balanced = balance(&components, &[10, 25]);
        // huge: device 0 has 10 < 30, host, turn stays at 0; big: 20 > 10, host; mid: device 0; small: device 1.
        let expected = [("huge", None), ("big", None), ("mid", Some(0)), ("small", Some(1))];
        assert_eq!(devices(&balanced), placed(&expected));
        assert_eq!(balanced.left, vec![1, 20]);
        assert_eq!(
            balanced.to_string().lines().next(),
            Some("huge (30 B) -> host (larger than its turn's device had left)")
        );
    }

    /// Equal sizes keep the order given; no device sends everything to the host.
    #[test]
    fn ties_keep_their_order_and_no_device_means_the_host() {
        let components = [("x", 5), ("y", 5)];
        assert_eq!(devices(&balance(&components, &[10, 10])), placed(&[("x", Some(0)), ("y", Some(1))]));
        assert_eq!(devices(&balance(&components, &[])), placed(&[("x", None), ("y", None)]));
    }
}
