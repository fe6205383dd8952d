//! The device memory plot (`--memory-plot FILE.png`): device memory allocated over time, from a timeline's
//! counter samples, with the moves marked and the phases shaded.
//!
//! It reads only the [`Timeline`]: the samples of its [`MEMORY_COUNTER`] track and its spans (phases, whole
//! component onloads and offloads, group uploads and releases), so what it draws is what the trace file holds.
//! Memory is drawn as a step line (a reading holds until the next one), in MB as the record prints them (binary:
//! 1 MB = 2^20 bytes), against seconds since the timeline's origin.
//!
//! Text needs a font, and plotters draws text only from a font file it is given (`ab_glyph`): the one in
//! [`PlotOptions::font`], or else the first of a few well-known system fonts ([`SYSTEM_FONTS`]). Without any, the
//! plot is drawn without its axes' labels, caption and legend, and [`PlotSummary::labelled`] says so.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use offload_core::timeline::{EventKind, MEMORY_COUNTER, Timeline, TimelineEvent, category};
use plotters::prelude::*;

use crate::error::{Error, Result};

/// Fonts tried, in order, when [`PlotOptions::font`] is not given: DejaVu Sans and Liberation Sans where Linux
/// distributions put them, Arial on macOS and Windows.
pub const SYSTEM_FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "/Library/Fonts/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

/// The family name the font is registered under with plotters.
const FAMILY: &str = "sans-serif";

/// The colour of the allocated-memory line.
pub const ALLOCATED_COLOUR: RGBColor = RGBColor(31, 119, 180);
const CAPACITY_COLOUR: RGBColor = RGBColor(90, 90, 90);
const ONLOAD_COLOUR: RGBColor = RGBColor(44, 160, 44);
const OFFLOAD_COLOUR: RGBColor = RGBColor(214, 39, 40);
const UPLOAD_COLOUR: RGBColor = RGBColor(148, 103, 189);
const RELEASE_COLOUR: RGBColor = RGBColor(255, 127, 14);
const PHASE_COLOURS: [RGBColor; 2] = [RGBColor(240, 240, 240), RGBColor(225, 232, 240)];
/// The allocated lines of the other devices of a device map, in the order they were first sampled.
pub const OTHER_DEVICE_COLOURS: [RGBColor; 3] = [RGBColor(140, 86, 75), RGBColor(23, 190, 207), RGBColor(188, 189, 34)];

/// How to draw the plot.
#[derive(Debug, Clone)]
pub struct PlotOptions {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// The card's capacity in bytes, drawn as a line when given.
    pub capacity: Option<u64>,
    /// The caption above the plot.
    pub title: String,
    /// A TrueType font for the text; `None` tries [`SYSTEM_FONTS`].
    pub font: Option<PathBuf>,
}

impl Default for PlotOptions {
    fn default() -> Self {
        Self { width: 1200, height: 600, capacity: None, title: "device memory".into(), font: None }
    }
}

/// What a drawn plot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlotSummary {
    /// Memory samples drawn (of every device).
    pub samples: usize,
    /// Devices drawn: one allocated line each (the first device sampled, then every other device of a device map).
    pub devices: usize,
    /// Moves marked: whole-component onloads and offloads, group uploads and releases.
    pub marks: usize,
    /// Group uploads drawn in the link panel below the memory plot (none: no panel). Each is its bytes ÷ its
    /// span's duration, as the trace's link rate track has it.
    pub link_samples: usize,
    /// Whether a font was found, so the axes, caption and legend are labelled.
    pub labelled: bool,
}

/// `(seconds at the upload's end, GB/s)` of every group upload span that carries its bytes.
fn link_rates(events: &[TimelineEvent]) -> Vec<(f64, f64)> {
    spans(events, category::UPLOAD)
        .filter_map(|e| {
            let EventKind::Span { duration_ns } = e.kind else { return None };
            let Some(offload_core::timeline::ArgValue::Number(bytes)) = e.arg("bytes") else { return None };
            // Bytes per nanosecond is GB/s.
            (duration_ns > 0).then(|| (seconds(e.start_ns + duration_ns), *bytes as f64 / duration_ns as f64))
        })
        .collect()
}

/// Registers the first readable font with plotters, once per process; returns whether one is registered.
fn register_font(preferred: Option<&Path>) -> bool {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    *REGISTERED.get_or_init(|| {
        let candidates = preferred.into_iter().map(Path::to_path_buf).chain(SYSTEM_FONTS.iter().map(PathBuf::from));
        for path in candidates {
            let Ok(bytes) = std::fs::read(&path) else { continue };
            // plotters keeps fonts for the life of the process; one font file is leaked, once.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font(FAMILY, FontStyle::Normal, bytes).is_ok() {
                tracing::debug!(font = %path.display(), "memory plot font");
                return true;
            }
        }
        false
    })
}

const MB: f64 = (1u64 << 20) as f64;

fn seconds(ns: u64) -> f64 {
    ns as f64 / 1e9
}

/// The spans a kind of mark is drawn from.
fn spans<'a>(events: &'a [TimelineEvent], category: &'a str) -> impl Iterator<Item = &'a TimelineEvent> + 'a {
    events.iter().filter(move |e| e.category == category && matches!(e.kind, EventKind::Span { .. }))
}

/// Draws device memory over time from `timeline` into the PNG file `path`, `options.width` by
/// `options.height` pixels. Fails with [`Error::Plot`] when the timeline holds no memory sample (it was recorded
/// without device readings), and with [`Error::OutputWrite`] when the file cannot be written (any file there is
/// kept as it was).
pub fn draw_memory_plot(timeline: &Timeline, path: &Path, options: &PlotOptions) -> Result<PlotSummary> {
    let plot_error = |reason: String| Error::Plot { path: path.to_path_buf(), reason };
    let samples = timeline.memory_samples();
    if samples.is_empty() {
        return Err(plot_error(
            "the timeline holds no device memory sample: record the run on a device with readings (a simulated \
             --card, or a real device)"
                .into(),
        ));
    }
    if options.width < 200 || options.height < 150 {
        return Err(plot_error(format!(
            "{}x{} pixels is too small to draw in; use at least 200x150",
            options.width, options.height
        )));
    }
    let events = timeline.events();
    let end_ns = events
        .iter()
        .map(|e| match e.kind {
            EventKind::Span { duration_ns } => e.start_ns + duration_ns,
            _ => e.start_ns,
        })
        .max()
        .unwrap_or(0);
    let x_max = seconds(end_ns).max(1e-6) * 1.02;
    // Every other device of a device map is a line of its own (its own track of the timeline).
    let others: Vec<(String, Vec<offload_core::timeline::MemorySample>)> =
        timeline.memory_tracks().into_iter().filter(|(track, _)| track != MEMORY_COUNTER).collect();
    let top = samples
        .iter()
        .chain(others.iter().flat_map(|(_, samples)| samples))
        .map(|s| s.allocated)
        .max()
        .unwrap_or(0)
        .max(options.capacity.unwrap_or(0));
    let y_max = (top as f64 / MB).max(1e-3) * 1.1;
    let labelled = register_font(options.font.as_deref());
    let rates = link_rates(&events);

    let (width, height) = (options.width, options.height);
    let mut buffer = vec![0u8; width as usize * height as usize * 3];
    let mut marks = 0;
    {
        let drawing = |e: &dyn std::fmt::Display| plot_error(format!("drawing failed: {e}"));
        let whole = BitMapBackend::with_buffer(&mut buffer, (width, height)).into_drawing_area();
        whole.fill(&WHITE).map_err(|e| drawing(&e))?;
        // With group uploads, the lower quarter is the link panel: each upload's measured rate over time.
        let (root, link_area) = if rates.is_empty() {
            (whole.clone(), None)
        } else {
            let (upper, lower) = whole.split_vertically(height * 3 / 4);
            (upper, Some(lower))
        };
        let mut builder = ChartBuilder::on(&root);
        builder.margin(12);
        if labelled {
            builder.caption(&options.title, (FAMILY, 20)).x_label_area_size(40).y_label_area_size(70);
        }
        let mut chart = builder.build_cartesian_2d(0f64..x_max, 0f64..y_max).map_err(|e| drawing(&e))?;
        if labelled {
            chart
                .configure_mesh()
                .x_desc("time since the run started (s)")
                .y_desc("device memory allocated (MB, 2^20 bytes)")
                .label_style((FAMILY, 14))
                .light_line_style(WHITE.mix(0.0))
                .draw()
                .map_err(|e| drawing(&e))?;
        }

        // Phases shade the background, alternating, with their names at the top.
        for (i, phase) in spans(&events, category::PHASE).filter(|e| !e.name.starts_with("release")).enumerate() {
            let EventKind::Span { duration_ns } = phase.kind else { continue };
            let (x0, x1) = (seconds(phase.start_ns), seconds(phase.start_ns + duration_ns));
            let colour = PHASE_COLOURS[i % 2];
            chart
                .draw_series(std::iter::once(Rectangle::new([(x0, 0.0), (x1, y_max)], colour.filled())))
                .map_err(|e| drawing(&e))?;
            if labelled {
                // Alternating rows, so the names of short phases do not overlap.
                let style = TextStyle::from((FAMILY, 13)).color(&BLACK);
                let y = y_max * if i % 2 == 0 { 0.985 } else { 0.95 };
                chart
                    .draw_series(std::iter::once(Text::new(format!(" {}", phase.name), (x0, y), style)))
                    .map_err(|e| drawing(&e))?;
            }
        }

        // Group moves are short, light vertical lines at their starts, one series per kind.
        for (kind, label, colour, height) in [
            (category::UPLOAD, "group upload", UPLOAD_COLOUR, 0.25),
            (category::RELEASE, "group release", RELEASE_COLOUR, 0.15),
        ] {
            let starts: Vec<f64> = spans(&events, kind).map(|e| seconds(e.start_ns)).collect();
            marks += starts.len();
            if starts.is_empty() {
                continue;
            }
            let style = colour.mix(0.5).stroke_width(1);
            let series = chart
                .draw_series(starts.iter().map(|x| PathElement::new(vec![(*x, 0.0), (*x, y_max * height)], style)))
                .map_err(|e| drawing(&e))?;
            let legend = colour.stroke_width(2);
            series.label(label).legend(move |(x, y)| PathElement::new(vec![(x + 8, y - 6), (x + 8, y + 6)], legend));
        }

        // Component moves span the height and are named: onloads solid, offloads dashed and drawn over them, so
        // an offload that made room for an onload a few microseconds later shows both.
        let pixel = x_max / f64::from(width);
        for (kind, label, colour, row) in [
            (category::ONLOAD, "component onload", ONLOAD_COLOUR, 0.62),
            (category::OFFLOAD, "component offload", OFFLOAD_COLOUR, 0.44),
        ] {
            let moves: Vec<&TimelineEvent> = spans(&events, kind).collect();
            marks += moves.len();
            let style = colour.stroke_width(2);
            for (i, event) in moves.iter().enumerate() {
                let x = seconds(event.start_ns);
                let line = [(x, 0.0), (x, y_max)];
                let series = if kind == category::ONLOAD {
                    chart.draw_series(LineSeries::new(line, style.stroke_width(3)))
                } else {
                    chart.draw_series(DashedLineSeries::new(line, 6, 6, style))
                }
                .map_err(|e| drawing(&e))?;
                if i == 0 {
                    series
                        .label(label)
                        .legend(move |(x, y)| PathElement::new(vec![(x + 8, y - 6), (x + 8, y + 6)], style));
                }
                if labelled {
                    // In the middle of the plot, where the memory line seldom is, on rows that cycle so the names
                    // of moves close in time do not overlap.
                    let row = row - 0.05 * (i % 3) as f64;
                    let sign = if kind == category::ONLOAD { "+" } else { "-" };
                    let text = TextStyle::from((FAMILY, 12)).color(&colour);
                    chart
                        .draw_series(std::iter::once(Text::new(
                            format!("{sign} {}", event.name),
                            (x + 4.0 * pixel, y_max * row),
                            text,
                        )))
                        .map_err(|e| drawing(&e))?;
                }
            }
        }

        if let Some(capacity) = options.capacity {
            let y = capacity as f64 / MB;
            chart
                .draw_series(LineSeries::new([(0.0, y), (x_max, y)], CAPACITY_COLOUR.stroke_width(1)))
                .map_err(|e| drawing(&e))?
                .label("card capacity")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], CAPACITY_COLOUR));
        }

        // A reading holds until the next one: a step line.
        let step_line = |samples: &[offload_core::timeline::MemorySample]| {
            let mut steps = Vec::with_capacity(samples.len() * 2 + 1);
            for (i, sample) in samples.iter().enumerate() {
                let (x, y) = (seconds(sample.at_ns), sample.allocated as f64 / MB);
                if i > 0 {
                    steps.push((x, steps.last().map_or(y, |p: &(f64, f64)| p.1)));
                }
                steps.push((x, y));
            }
            if let Some(last) = steps.last().copied() {
                steps.push((seconds(end_ns), last.1));
            }
            steps
        };
        chart
            .draw_series(LineSeries::new(step_line(&samples), ALLOCATED_COLOUR.stroke_width(2)))
            .map_err(|e| drawing(&e))?
            .label(format!("allocated ({MEMORY_COUNTER} samples)"))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], ALLOCATED_COLOUR.stroke_width(2)));
        for (i, (track, samples)) in others.iter().enumerate() {
            let colour = OTHER_DEVICE_COLOURS[i % OTHER_DEVICE_COLOURS.len()];
            chart
                .draw_series(LineSeries::new(step_line(samples), colour.stroke_width(2)))
                .map_err(|e| drawing(&e))?
                .label(format!("allocated ({track} samples)"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], colour.stroke_width(2)));
        }

        if labelled {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK.mix(0.4))
                .label_font((FAMILY, 13))
                .draw()
                .map_err(|e| drawing(&e))?;
        }
        if let Some(area) = link_area {
            let rate_max = rates.iter().map(|(_, r)| *r).fold(0.0, f64::max).max(1e-6) * 1.1;
            let mut builder = ChartBuilder::on(&area);
            builder.margin(12);
            if labelled {
                builder.x_label_area_size(30).y_label_area_size(70);
            }
            let mut link = builder.build_cartesian_2d(0f64..x_max, 0f64..rate_max).map_err(|e| drawing(&e))?;
            if labelled {
                link.configure_mesh()
                    .y_desc("group upload (GB/s, measured)")
                    .label_style((FAMILY, 12))
                    .light_line_style(WHITE.mix(0.0))
                    .draw()
                    .map_err(|e| drawing(&e))?;
            }
            link.draw_series(rates.iter().map(|(x, r)| Circle::new((*x, *r), 2, UPLOAD_COLOUR.filled())))
                .map_err(|e| drawing(&e))?;
        }
        whole.present().map_err(|e| drawing(&e))?;
    }
    let image = image::RgbImage::from_raw(width, height, buffer)
        .ok_or_else(|| plot_error("the drawn buffer has the wrong size".into()))?;
    // Encoded in memory first, then written under a temporary name and renamed, so a failure leaves any file at
    // `path` as it was.
    let mut png = Vec::new();
    image
        .write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)
        .map_err(|e| plot_error(format!("cannot encode it: {e}")))?;
    crate::output::write_bytes_atomic(path, &png)?;
    let drawn = samples.len() + others.iter().map(|(_, samples)| samples.len()).sum::<usize>();
    Ok(PlotSummary { samples: drawn, devices: 1 + others.len(), marks, link_samples: rates.len(), labelled })
}
