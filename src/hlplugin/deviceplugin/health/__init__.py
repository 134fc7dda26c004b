"""Health: named conditions and their tracker, the producers that keep them (a check on a watch,
on ticks, in a bounded runner), and the aggregation of repeated log lines. Imports only the
package root (metrics, files, quoting): never the kubelet or process wings."""
