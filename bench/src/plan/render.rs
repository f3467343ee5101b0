//! The plan as Markdown (capacity table, pools, loss check, autoscaler targets) and as an SVG
//! of token rates per window.

use std::fmt::Write;

use crate::plan::CapacityPlan;

fn opt(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.0}")).unwrap_or_else(|| "-".into())
}

/// The plan in Markdown.
pub fn markdown(p: &CapacityPlan) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# Capacity plan\n\nCost model: {}\n", p.cost_source);
    let _ = writeln!(
        s,
        "Demand in {} window(s) of {:.0} s; scale-out time {:.0} s.\n",
        p.windows.len(),
        p.window_s,
        p.scale_out_s
    );
    s.push_str("## Per class\n\n");
    s.push_str("| class | requests (retries, refused) | input tokens mean / p50 / p95 / max | output tokens mean / p50 / p95 / max | TTFT p95 target / measured / idle ms | ITL p95 target / measured ms | peak input tok/s | peak output tok/s | peak KV blocks |\n");
    s.push_str("|---|---|---|---|---|---|---|---|---|\n");
    for c in &p.classes {
        let d = |d: &crate::plan::Dist| format!("{:.0} / {} / {} / {}", d.mean, opt(d.p50), opt(d.p95), opt(d.max));
        let _ = writeln!(
            s,
            "| {} | {} ({}, {}) | {} | {} | {:.0} / {} / {:.0} | {:.0} / {} | {:.0} | {:.0} | {:.0} |",
            c.class,
            c.requests,
            c.retries,
            c.refused,
            d(&c.input_tokens),
            d(&c.output_tokens),
            c.target.ttft_ms,
            opt(c.ttft_p95_ms),
            c.idle_ttft_p95_ms,
            c.target.itl_ms,
            opt(c.itl_p95_ms),
            c.peak_input_tok_s,
            c.peak_output_tok_s,
            c.peak_kv_blocks
        );
    }
    let b = &p.batch;
    let _ = writeln!(
        s,
        "\n## Pools\n\n| pool | per replica | peak | growth during scale-out | serving replicas | + spare = replicas | one replica lost |\n|---|---|---|---|---|---|---|"
    );
    let _ = writeln!(
        s,
        "| prefill | {:.2} busy (utilization target) | {:.2} busy workers | {:.2} | {} | {} | utilization {:.2}{} |",
        p.prefill.per_replica,
        p.prefill.peak,
        p.prefill.growth,
        p.prefill.serving,
        p.prefill.replicas,
        p.prefill.after_loss,
        if p.prefill.cascade { " — queue grows without bound" } else { "" }
    );
    let _ = writeln!(
        s,
        "| decode | {:.0} tok/s | {:.0} tok/s | {:.0} tok/s | {} | {} | {:.2} of the KV limit per replica{} |",
        p.decode.per_replica,
        p.decode.peak,
        p.decode.growth,
        p.decode.serving,
        p.decode.replicas,
        p.decode.after_loss,
        if p.decode.cascade { " — reservations refused: KV cascade" } else { "" }
    );
    let _ = writeln!(
        s,
        "\nDecode step: mean context {:.0} tokens, {} blocks per reservation; batch limit {} by the ITL SLO, {} by KV; planned batch {} at {:.1} ms per step; {:.0} sequences at the peak ({}), KV usage {:.0}% of the planned pool.",
        b.mean_context,
        b.blocks_per_sequence,
        b.itl_limit,
        b.kv_limit,
        b.planned,
        b.step_ms,
        b.peak_sequences,
        p.decode_percentile.map_or("their mean".to_string(), |q| format!("p{:.0} over time", q * 100.0)),
        b.peak_kv_usage * 100.0
    );
    let k = &p.keda;
    let _ = writeln!(
        s,
        "\n## Autoscaler targets (KEDA, per replica)\n\n- prefill: `pd_waiting_prefill_tokens` {} , `pd_queue_oldest_age_seconds` {:.2}\n- decode: `pd_running_decode_sequences` {} , `pd_kv_cache_usage_ratio` {:.2}",
        k.prefill_waiting_tokens, k.prefill_queue_age_s, k.decode_running_sequences, k.decode_kv_usage
    );
    if !p.warnings.is_empty() {
        s.push_str("\n## Warnings\n\n");
        for w in &p.warnings {
            let _ = writeln!(s, "- {w}");
        }
    }
    s
}

/// Input and output tokens/s per window, one line per class and direction.
pub fn svg(p: &CapacityPlan) -> String {
    let (w, h, pad) = (720.0, 360.0, 50.0);
    let mut series: Vec<(String, Vec<f64>)> = Vec::new();
    for c in &p.classes {
        for (dir, pick) in [("input", true), ("output", false)] {
            let v = p
                .windows
                .iter()
                .map(|win| {
                    let m = if pick { &win.input_tok_s } else { &win.output_tok_s };
                    m.get(&c.class).copied().unwrap_or(0.0)
                })
                .collect();
            series.push((format!("{} {dir}", c.class), v));
        }
    }
    let max = series.iter().flat_map(|(_, v)| v.iter().copied()).fold(1.0, f64::max);
    let n = p.windows.len().max(2) - 1;
    let x = |i: usize| pad + (w - 2.0 * pad) * i as f64 / n as f64;
    let y = |v: f64| h - pad - (h - 2.0 * pad) * v / max;
    let colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"];
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<text x=\"{pad}\" y=\"20\">tokens/s per {:.0} s window (max {max:.0})</text>\n<line x1=\"{pad}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n",
        p.window_s,
        h - pad,
        w - pad,
        h - pad
    );
    for (k, (name, v)) in series.iter().enumerate() {
        let color = colors[k % colors.len()];
        let points: Vec<String> = v.iter().enumerate().map(|(i, &val)| format!("{:.1},{:.1}", x(i), y(val))).collect();
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>",
            points.join(" ")
        );
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" fill=\"{color}\">{name}</text>",
            w - pad - 150.0,
            40.0 + 14.0 * k as f64
        );
    }
    s.push_str("</svg>\n");
    s
}
