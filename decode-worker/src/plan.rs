//! The batch planner: how many tokens each running sequence runs in the next step. A pure
//! function of the prefill policy and the sequences' phases, shared with pd-sim's simulated
//! decode worker, so a simulated fleet batches prompts prefilled on its decode workers as the
//! real one does.

use crate::batch::PrefillPolicy;

/// A running sequence, as the planner sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Row {
    /// Generating: one token per step.
    Decode,
    /// Its prompt is computed here, `left` tokens of it still to run.
    Prompt { left: usize },
}

/// Tokens each row runs in the next step, in order: 1 for a decoding row; for a prompt, the
/// chunk the policy admits (maybe 0). Chunked: prompt chunks fill what the decode rows leave
/// of `step_tokens`, first come first served, and at least a quarter of `step_tokens` of
/// prompt runs per step even under a full decode batch. Naive: the first waiting prompt runs
/// whole, one prompt per step.
pub fn plan(policy: PrefillPolicy, rows: &[Row]) -> Vec<usize> {
    let decoding = rows.iter().filter(|r| matches!(r, Row::Decode)).count();
    let mut budget = match policy {
        PrefillPolicy::Chunked { step_tokens } => step_tokens.saturating_sub(decoding).max(step_tokens / 4).max(1),
        PrefillPolicy::Naive => usize::MAX,
    };
    let mut prompts_this_step = 0;
    let mut take_prompt = |left: usize| {
        if budget == 0 || (policy == PrefillPolicy::Naive && prompts_this_step > 0) {
            return 0;
        }
        let take = left.min(budget);
        budget -= take;
        prompts_this_step += 1;
        take
    };
    rows.iter()
        .map(|r| match *r {
            Row::Decode => 1,
            Row::Prompt { left } => take_prompt(left),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHUNKED: PrefillPolicy = PrefillPolicy::Chunked { step_tokens: 256 };

    #[test]
    fn prompt_chunks_fill_what_the_decode_rows_leave_first_come_first_served() {
        let rows = [Row::Decode, Row::Prompt { left: 200 }, Row::Decode, Row::Prompt { left: 500 }];
        assert_eq!(plan(CHUNKED, &rows), [1, 200, 1, 54], "256 - 2 decode rows = 254 prompt tokens");
        // A full decode batch still moves a prompt by a quarter of the step.
        let mut busy = vec![Row::Decode; 300];
        busy.push(Row::Prompt { left: 1000 });
        assert_eq!(plan(CHUNKED, &busy).last(), Some(&64));
        assert_eq!(plan(CHUNKED, &[]), Vec::<usize>::new());
    }

    #[test]
    fn naive_runs_one_whole_prompt_per_step() {
        let rows = [Row::Prompt { left: 3000 }, Row::Decode, Row::Prompt { left: 10 }];
        assert_eq!(plan(PrefillPolicy::Naive, &rows), [3000, 1, 0]);
    }
}
