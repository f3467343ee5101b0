//! Least squares for the cost model's few coefficients, none of which may be negative (a
//! negative per-token cost fitted to noise would predict faster steps for more work): solve,
//! drop the most negative coefficient, solve again. Rows are weighted by 1/y, so a 30 ms and a
//! 3 s measurement count alike (relative error).

/// Coefficients `c >= 0` minimising the relative error of `x . c` against `y`, one per
/// feature; None when there are fewer rows than features or the system is degenerate.
pub fn fit_non_negative(rows: &[(Vec<f64>, f64)]) -> Option<Vec<f64>> {
    let n = rows.first()?.0.len();
    if rows.len() < n || rows.iter().any(|(x, y)| x.len() != n || !y.is_finite() || *y <= 0.0) {
        return None;
    }
    let mut active: Vec<usize> = (0..n).collect();
    while !active.is_empty() {
        let c = solve(rows, &active)?;
        match c.iter().enumerate().filter(|(_, v)| **v < 0.0).min_by(|a, b| a.1.total_cmp(b.1)) {
            Some((i, _)) => {
                active.remove(i);
            }
            None => {
                let mut out = vec![0.0; n];
                for (k, &f) in active.iter().enumerate() {
                    out[f] = c[k];
                }
                return Some(out);
            }
        }
    }
    Some(vec![0.0; n])
}

/// Weighted normal equations over the `active` features, by Gaussian elimination.
fn solve(rows: &[(Vec<f64>, f64)], active: &[usize]) -> Option<Vec<f64>> {
    let k = active.len();
    let mut a = vec![vec![0.0; k + 1]; k];
    for (x, y) in rows {
        let w = 1.0 / (y * y);
        for i in 0..k {
            for j in 0..k {
                a[i][j] += w * x[active[i]] * x[active[j]];
            }
            a[i][k] += w * x[active[i]] * y;
        }
    }
    for col in 0..k {
        let pivot = (col..k).max_by(|&p, &q| a[p][col].abs().total_cmp(&a[q][col].abs()))?;
        if a[pivot][col].abs() < 1e-300 {
            return None;
        }
        a.swap(col, pivot);
        for row in 0..k {
            if row != col {
                let f = a[row][col] / a[col][col];
                let pivot_row = a[col].clone();
                for (v, p) in a[row].iter_mut().zip(&pivot_row).skip(col) {
                    *v -= f * p;
                }
            }
        }
    }
    Some((0..k).map(|i| a[i][k] / a[i][i]).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovers_exact_coefficients() {
        // y = 3 + 2 a + 0.5 b
        let rows: Vec<_> = [(1.0, 4.0), (2.0, 1.0), (5.0, 7.0), (9.0, 3.0)]
            .iter()
            .map(|&(a, b)| (vec![1.0, a, b], 3.0 + 2.0 * a + 0.5 * b))
            .collect();
        let c = fit_non_negative(&rows).expect("fit");
        for (got, want) in c.iter().zip([3.0, 2.0, 0.5]) {
            assert!((got - want).abs() < 1e-9, "{c:?}");
        }
    }

    #[test]
    fn a_coefficient_that_would_be_negative_is_zero_and_the_rest_refit() {
        // y = 10 + 1 a - 0.1 b: b's coefficient must not go below zero.
        let rows: Vec<_> = [(1.0, 1.0), (2.0, 5.0), (3.0, 2.0), (4.0, 8.0)]
            .iter()
            .map(|&(a, b)| (vec![1.0, a, b], 10.0 + a - 0.1 * b))
            .collect();
        let c = fit_non_negative(&rows).expect("fit");
        assert_eq!(c[2], 0.0);
        assert!(c[0] > 0.0 && c[1] > 0.0, "{c:?}");
    }

    #[test]
    fn too_few_rows_or_bad_values_give_none() {
        assert!(fit_non_negative(&[(vec![1.0, 2.0], 3.0)]).is_none());
        assert!(fit_non_negative(&[(vec![1.0], f64::NAN)]).is_none());
        assert!(fit_non_negative(&[]).is_none());
    }
}
