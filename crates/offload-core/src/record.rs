//! The offload record: every move the manager (or a group offloader) made, with the reading it was made on.
//!
//! The record is a bounded list of [`OffloadEvent`]s. Its [`Display`](fmt::Display) is byte-identical to the
//! anchor's `OffloadRecord.__repr__` (diffusers PR #14304): one row per decision, the offloads that made room for
//! an onload folded into its row. Programs walk the same rows as data with [`OffloadRecord::rows`].

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::size::format_size;

/// The most events a record keeps; the oldest are dropped past this.
pub const MAX_EVENTS: usize = 10_000;

/// Which way a component (or a group of one) moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Moved from the host onto the execution device.
    Onload,
    /// Moved from the execution device to the host.
    Offload,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Action::Onload => "onload",
            Action::Offload => "offload",
        })
    }
}

/// Why a move happened. Its `Display` is the anchor's reason string.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Offloaded by the strategy to make room for the named component (`release_memory_for:<id>`).
    ReleaseMemoryFor(String),
    /// Offloaded after the named component ran out of memory (`oom_retry:<id>`).
    OomRetry(String),
    /// Offloaded because auto offload was disabled (`offloading_disabled`).
    OffloadingDisabled,
    /// A group uploaded when the model took it: the capture pass, or a miss (`group_onload`).
    GroupOnload,
    /// A group uploaded ahead of its use by the prefetch worker (`prefetch`).
    Prefetch,
    /// A group released from the device after its use (`group_offload`).
    GroupOffload,
    /// A move made by a mechanism outside the workspace, printed as given.
    Other(String),
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::ReleaseMemoryFor(id) => write!(f, "release_memory_for:{id}"),
            Reason::OomRetry(id) => write!(f, "oom_retry:{id}"),
            Reason::OffloadingDisabled => f.write_str("offloading_disabled"),
            Reason::GroupOnload => f.write_str("group_onload"),
            Reason::Prefetch => f.write_str("prefetch"),
            Reason::GroupOffload => f.write_str("group_offload"),
            Reason::Other(text) => f.write_str(text),
        }
    }
}

/// One move, with the device reading taken just before it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffloadEvent {
    /// Onload or offload.
    pub action: Action,
    /// The component (or `component/group`) that moved.
    pub id: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// Why; `None` on an onload the incoming component asked for.
    pub reason: Option<Reason>,
    /// Bytes available on the device just before the move.
    pub available: Option<u64>,
    /// The device's peak allocation just before the move.
    pub peak: Option<u64>,
}

/// One row of the record's table: one decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordRow {
    /// The component onloaded by this decision, with its size; `None` for a row that only offloads.
    pub onload: Option<(String, u64)>,
    /// The components offloaded by this decision, with their sizes, in the order they moved.
    pub offloaded: Vec<(String, u64)>,
    /// Available bytes before the decision's first move.
    pub available: Option<u64>,
    /// Peak bytes before the decision's first move.
    pub peak: Option<u64>,
    /// The reason column: empty for a plain onload.
    pub reason: String,
}

/// A shared, bounded record of moves. Cloning shares it: the manager and every group offloader write into one.
///
/// The lock inside protects only the event list; it is taken for a push or a copy, never while a move runs.
#[derive(Clone, Default)]
pub struct OffloadRecord {
    events: Arc<Mutex<Events>>,
}

#[derive(Default)]
struct Events {
    kept: VecDeque<OffloadEvent>,
    /// Events added since the last clear, dropped ones included.
    added: u64,
}

impl std::ops::Deref for Events {
    type Target = VecDeque<OffloadEvent>;

    fn deref(&self) -> &Self::Target {
        &self.kept
    }
}

impl fmt::Debug for OffloadRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OffloadRecord").field("events", &self.len()).finish()
    }
}

impl OffloadRecord {
    /// An empty record.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends an event, dropping the oldest past [`MAX_EVENTS`].
    pub fn add(&self, event: OffloadEvent) {
        let mut events = self.events.lock();
        if events.kept.len() == MAX_EVENTS {
            events.kept.pop_front();
        }
        events.kept.push_back(event);
        events.added += 1;
    }

    /// Forgets every event.
    pub fn clear(&self) {
        let mut events = self.events.lock();
        events.kept.clear();
        events.added = 0;
    }

    /// Events added since the last clear, including those dropped past [`MAX_EVENTS`].
    pub fn total_added(&self) -> u64 {
        self.events.lock().added
    }

    /// How many events are kept.
    pub fn len(&self) -> usize {
        self.events.lock().len()
    }

    /// Whether nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.events.lock().is_empty()
    }

    /// A copy of the events, oldest first.
    pub fn events(&self) -> Vec<OffloadEvent> {
        self.events.lock().iter().cloned().collect()
    }

    /// The table's rows as data: one per decision, exactly as [`Display`](fmt::Display) prints them.
    pub fn rows(&self) -> Vec<RecordRow> {
        rows_of(&self.events())
    }

    /// The number of offload events, by component id.
    pub fn offload_counts(&self) -> HashMap<String, usize> {
        let mut counts = HashMap::new();
        for event in self.events.lock().iter().filter(|e| e.action == Action::Offload) {
            *counts.entry(event.id.clone()).or_insert(0) += 1;
        }
        counts
    }
}

fn rows_of(events: &[OffloadEvent]) -> Vec<RecordRow> {
    let mut rows = Vec::new();
    // Offloads that make room for an onload come before it; they wait here until it arrives.
    let mut pending: Vec<(String, Vec<&OffloadEvent>)> = Vec::new();
    for event in events {
        match (&event.action, &event.reason) {
            (Action::Onload, _) => {
                let caused = match pending.iter().position(|(target, _)| *target == event.id) {
                    Some(index) => pending.remove(index).1,
                    None => Vec::new(),
                };
                let first = caused.first().copied().unwrap_or(event);
                rows.push(RecordRow {
                    onload: Some((event.id.clone(), event.bytes)),
                    offloaded: caused.iter().map(|e| (e.id.clone(), e.bytes)).collect(),
                    available: first.available,
                    peak: first.peak,
                    reason: event.reason.as_ref().map(ToString::to_string).unwrap_or_default(),
                });
            }
            (Action::Offload, Some(Reason::ReleaseMemoryFor(target))) => {
                match pending.iter_mut().find(|(t, _)| t == target) {
                    Some((_, list)) => list.push(event),
                    None => pending.push((target.clone(), vec![event])),
                }
            }
            (Action::Offload, reason) => rows.push(RecordRow {
                onload: None,
                offloaded: vec![(event.id.clone(), event.bytes)],
                available: event.available,
                peak: event.peak,
                reason: reason.as_ref().map(ToString::to_string).unwrap_or_default(),
            }),
        }
    }
    for (target, list) in pending {
        for event in list {
            rows.push(RecordRow {
                onload: None,
                offloaded: vec![(event.id.clone(), event.bytes)],
                available: event.available,
                peak: event.peak,
                reason: format!("release_memory_for:{target}"),
            });
        }
    }
    rows
}

fn label(id: &str, sizes: &HashMap<&str, u64>) -> String {
    format!("{id} ({})", sizes.get(id).map_or_else(|| "-".to_string(), |b| format_size(*b)))
}

/// Formats rows as the anchor's `format_table`: every column padded to its widest cell except the last, cells
/// joined by `" | "`, trailing spaces stripped.
pub fn format_table(headers: &[&str], rows: &[Vec<String>]) -> Vec<String> {
    let columns = headers.len();
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate().take(columns) {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let padded: Vec<String> = cells
            .enumerate()
            .map(|(i, cell)| if i + 1 == columns { cell.to_string() } else { format!("{cell:<w$}", w = widths[i]) })
            .collect();
        padded.join(" | ").trim_end().to_string()
    };
    let mut lines = vec![line(&mut headers.iter().copied())];
    for row in rows {
        lines.push(line(&mut row.iter().map(String::as_str)));
    }
    lines
}

impl fmt::Display for OffloadRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let events = self.events();
        if events.is_empty() {
            return f.write_str("Offload record: nothing recorded yet");
        }
        // The last size seen for an id labels it everywhere, as the anchor does.
        let mut sizes: HashMap<&str, u64> = HashMap::new();
        for event in &events {
            sizes.insert(event.id.as_str(), event.bytes);
        }
        let size = |b: Option<u64>| b.map_or_else(|| "-".to_string(), format_size);
        let cells: Vec<Vec<String>> = rows_of(&events)
            .into_iter()
            .enumerate()
            .map(|(i, row)| {
                let offloaded: Vec<String> = row.offloaded.iter().map(|(id, _)| label(id, &sizes)).collect();
                vec![
                    (i + 1).to_string(),
                    row.onload.as_ref().map_or_else(|| "-".to_string(), |(id, _)| label(id, &sizes)),
                    if offloaded.is_empty() { "-".to_string() } else { offloaded.join(", ") },
                    size(row.available),
                    size(row.peak),
                    row.reason,
                ]
            })
            .collect();
        let lines = format_table(&["#", "Onload", "Offloaded", "Available", "Peak", "Reason"], &cells);
        writeln!(f, "{}", lines[0])?;
        write!(f, "{}", "-".repeat(lines[0].chars().count()))?;
        for line in &lines[1..] {
            write!(f, "\n{line}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: f64 = (1u64 << 30) as f64;

    fn gib(x: f64) -> u64 {
        (x * GIB) as u64
    }

    fn event(action: Action, id: &str, bytes: u64, reason: Option<Reason>, available: u64, peak: u64) -> OffloadEvent {
        OffloadEvent { action, id: id.into(), bytes, reason, available: Some(available), peak: Some(peak) }
    }

    /// The 20GB table from the anchor's docs, rebuilt from its events, byte for byte (no closing dash line).
    #[test]
    fn reproduces_the_anchor_docs_table() {
        let record = OffloadRecord::new();
        let te = "text_encoder_129824856400544";
        let tr = "transformer_129824854851072";
        let vae = "vae_129824905851968";
        record.add(event(Action::Onload, te, 8_044_936_192, None, gib(18.02), 8704));
        record.add(event(
            Action::Offload,
            te,
            8_044_936_192,
            Some(Reason::ReleaseMemoryFor(tr.into())),
            gib(10.384),
            gib(7.77),
        ));
        record.add(event(Action::Onload, tr, 12_309_817_472, None, gib(17.9), gib(7.8)));
        record.add(event(Action::Onload, vae, 167_639_366, None, gib(6.36), gib(12.07)));
        let expected = "\
# | Onload                                 | Offloaded                              | Available | Peak     | Reason
-------------------------------------------------------------------------------------------------------------------
1 | text_encoder_129824856400544 (7.49 GB) | -                                      | 18.02 GB  | 8.50 KB  |
2 | transformer_129824854851072 (11.46 GB) | text_encoder_129824856400544 (7.49 GB) | 10.38 GB  | 7.77 GB  |
3 | vae_129824905851968 (159.87 MB)        | -                                      | 6.36 GB   | 12.07 GB |";
        assert_eq!(record.to_string(), expected);
    }

    #[test]
    fn oom_and_disable_rows_stand_alone_and_leftovers_come_last() {
        let record = OffloadRecord::new();
        record.add(event(Action::Onload, "a_1", 4096, None, 70 * 1024, 0));
        record.add(event(Action::Offload, "b_2", 2048, Some(Reason::OomRetry("a_1".into())), 1024, 4096));
        record.add(event(Action::Offload, "c_3", 1024, Some(Reason::ReleaseMemoryFor("d_4".into())), 1024, 4096));
        record.add(event(Action::Offload, "a_1", 4096, Some(Reason::OffloadingDisabled), 2048, 4096));
        let expected = "\
# | Onload        | Offloaded     | Available | Peak    | Reason
----------------------------------------------------------------
1 | a_1 (4.00 KB) | -             | 70.00 KB  | 0 B     |
2 | -             | b_2 (2.00 KB) | 1.00 KB   | 4.00 KB | oom_retry:a_1
3 | -             | a_1 (4.00 KB) | 2.00 KB   | 4.00 KB | offloading_disabled
4 | -             | c_3 (1.00 KB) | 1.00 KB   | 4.00 KB | release_memory_for:d_4";
        assert_eq!(record.to_string(), expected);
        let rows = record.rows();
        assert_eq!(rows.len(), 4);
        assert_eq!(rows[1].reason, "oom_retry:a_1");
        assert_eq!(rows[3].offloaded, vec![("c_3".to_string(), 1024)]);
    }

    #[test]
    fn empty_record_says_so_and_is_bounded() {
        let record = OffloadRecord::new();
        assert_eq!(record.to_string(), "Offload record: nothing recorded yet");
        for i in 0..MAX_EVENTS + 5 {
            record.add(event(Action::Onload, &format!("c_{i}"), 1, None, 1, 1));
        }
        assert_eq!(record.len(), MAX_EVENTS);
        assert_eq!(record.events()[0].id, "c_5");
        let shared = record.clone();
        shared.clear();
        assert!(record.is_empty());
    }
}
