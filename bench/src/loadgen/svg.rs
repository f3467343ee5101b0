//! Plain SVG plots (no plotting dependency): empirical distributions (CDF over a log time
//! axis) of several series, and a timeline of inter-token gaps with event markers.

const W: f64 = 720.0;
const H: f64 = 400.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
const COLORS: [&str; 8] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// Log10 axis bounds covering `values` (decades).
fn log_bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::MAX, f64::MIN);
    for v in values.filter(|v| *v > 0.0 && v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if lo > hi {
        return (0.0, 3.0);
    }
    let (a, b) = (lo.log10().floor(), hi.log10().ceil());
    (a, if b <= a { a + 1.0 } else { b })
}

fn frame(title: &str, x_label: &str, y_label: &str) -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">{}</text>\n\
         <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n\
         <text x=\"16\" y=\"{}\" text-anchor=\"middle\" transform=\"rotate(-90 16 {})\">{}</text>\n\
         <rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#444\"/>\n",
        W / 2.0,
        escape(title),
        LEFT + (W - LEFT - RIGHT) / 2.0,
        H - 12.0,
        escape(x_label),
        TOP + (H - TOP - BOTTOM) / 2.0,
        TOP + (H - TOP - BOTTOM) / 2.0,
        escape(y_label),
        W - LEFT - RIGHT,
        H - TOP - BOTTOM
    )
}

fn log_ticks(out: &mut String, (a, b): (f64, f64), horizontal: bool) {
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let mut d = a;
    while d <= b + 1e-9 {
        let f = (d - a) / (b - a);
        let label = format!("{}", 10f64.powf(d));
        if horizontal {
            let x = LEFT + f * pw;
            out.push_str(&format!(
                "<line x1=\"{x:.1}\" y1=\"{TOP}\" x2=\"{x:.1}\" y2=\"{}\" stroke=\"#ddd\"/><text x=\"{x:.1}\" y=\"{}\" text-anchor=\"middle\">{label}</text>\n",
                TOP + ph,
                TOP + ph + 16.0
            ));
        } else {
            let y = TOP + ph - f * ph;
            out.push_str(&format!(
                "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{}\" y2=\"{y:.1}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{label}</text>\n",
                LEFT + pw,
                LEFT - 6.0,
                y + 4.0
            ));
        }
        d += 1.0;
    }
}

fn legend(out: &mut String, names: &[&str]) {
    for (i, name) in names.iter().enumerate() {
        let y = TOP + 10.0 + i as f64 * 18.0;
        out.push_str(&format!(
            "<rect x=\"{}\" y=\"{:.1}\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{}\" y=\"{:.1}\">{}</text>\n",
            W - RIGHT + 10.0,
            y - 10.0,
            COLORS[i % COLORS.len()],
            W - RIGHT + 28.0,
            y,
            escape(name)
        ));
    }
}

/// Empirical CDFs of each series (values in ms) on a log x axis.
pub fn distribution(title: &str, x_label: &str, series: &[(String, Vec<f64>)]) -> String {
    let bounds = log_bounds(series.iter().flat_map(|(_, v)| v.iter().copied()));
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let mut out = frame(title, x_label, "fraction of samples at or below");
    log_ticks(&mut out, bounds, true);
    for q in [0.0, 0.5, 0.95, 1.0].iter() {
        let y = TOP + ph - q * ph;
        out.push_str(&format!("<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{q}</text>\n", LEFT - 6.0, y + 4.0));
        if *q == 0.95 {
            out.push_str(&format!("<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{}\" y2=\"{y:.1}\" stroke=\"#bbb\" stroke-dasharray=\"4 3\"/>\n", LEFT + pw));
        }
    }
    for (i, (_, values)) in series.iter().enumerate() {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| *x > 0.0 && x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            continue;
        }
        let n = v.len() as f64;
        let step = (v.len() / 400).max(1);
        let points: Vec<String> = v
            .iter()
            .enumerate()
            .filter(|(k, _)| k % step == 0 || *k == v.len() - 1)
            .map(|(k, x)| {
                let fx = (x.log10() - bounds.0) / (bounds.1 - bounds.0);
                format!("{:.1},{:.1}", LEFT + fx * pw, TOP + ph - ((k + 1) as f64 / n) * ph)
            })
            .collect();
        out.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.8\" points=\"{}\"/>\n",
            COLORS[i % COLORS.len()],
            points.join(" ")
        ));
    }
    let names: Vec<&str> = series.iter().map(|(n, _)| n.as_str()).collect();
    legend(&mut out, &names);
    out.push_str("</svg>\n");
    out
}

/// Most points a timeline draws: every gap above the 90th percentile (the stalls it is
/// there to show) and an even sample of the rest, so the file stays small.
const TIMELINE_POINTS: usize = 4000;

fn thin(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    if points.len() <= TIMELINE_POINTS {
        return points.to_vec();
    }
    let mut gaps: Vec<f64> = points.iter().map(|p| p.1).collect();
    gaps.sort_by(f64::total_cmp);
    let p90 = gaps[gaps.len() * 9 / 10];
    let high = points.iter().filter(|p| p.1 > p90).count();
    let every = (points.len() - high).div_ceil(TIMELINE_POINTS.saturating_sub(high).max(1)).max(1);
    let mut low_seen = 0;
    points
        .iter()
        .filter(|p| {
            if p.1 > p90 {
                return true;
            }
            low_seen += 1;
            low_seen % every == 0
        })
        .copied()
        .collect()
}

/// Inter-token gaps over time (`points`: seconds since start, gap in ms; log y axis) with
/// a vertical marker at each time in `marks` (e.g. long-prompt arrivals).
pub fn timeline(title: &str, points: &[(f64, f64)], marks: &[f64], mark_label: &str) -> String {
    let points = &thin(points);
    let t_max = points.iter().map(|p| p.0).chain(marks.iter().copied()).fold(1.0, f64::max);
    let bounds = log_bounds(points.iter().map(|p| p.1));
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let mut out = frame(title, "time since start (s)", "inter-token gap (ms)");
    log_ticks(&mut out, bounds, false);
    for k in 0..=5 {
        let t = t_max * k as f64 / 5.0;
        let x = LEFT + t / t_max * pw;
        out.push_str(&format!("<text x=\"{x:.1}\" y=\"{}\" text-anchor=\"middle\">{t:.0}</text>\n", TOP + ph + 16.0));
    }
    for m in marks {
        let x = LEFT + m / t_max * pw;
        out.push_str(&format!(
            "<line x1=\"{x:.1}\" y1=\"{TOP}\" x2=\"{x:.1}\" y2=\"{}\" stroke=\"{}\" stroke-width=\"1\"/>\n",
            TOP + ph,
            COLORS[1]
        ));
    }
    for (t, gap) in points.iter().filter(|p| p.1 > 0.0) {
        let x = LEFT + t / t_max * pw;
        let y = TOP + ph - (gap.log10() - bounds.0) / (bounds.1 - bounds.0) * ph;
        out.push_str(&format!("<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"1.3\" fill=\"{}\"/>\n", COLORS[0]));
    }
    legend(&mut out, &["inter-token gap", mark_label]);
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plots_are_svg_with_every_series() {
        let svg = distribution("TTFT", "ms", &[("a".into(), vec![1.0, 10.0, 100.0]), ("b<c".into(), vec![5.0])]);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("b&lt;c"));
        let t = timeline("ITL", &[(0.5, 12.0), (1.0, 900.0)], &[0.7], "document");
        assert_eq!(t.matches("<circle").count(), 2);
        // Large timelines keep every high gap and a sample of the rest.
        let many: Vec<(f64, f64)> = (0..20_000)
            .map(|i| (i as f64 / 100.0, if i % 1000 == 0 { 5000.0 } else { 20.0 + (i % 7) as f64 }))
            .collect();
        let thinned = thin(&many);
        assert!(thinned.len() <= TIMELINE_POINTS + 20, "{}", thinned.len());
        assert_eq!(thinned.iter().filter(|p| p.1 == 5000.0).count(), 20, "every stall kept");
    }
}
